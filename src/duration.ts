// Durations as people write them: 24h, 15m, 90s, 500ms, 2d, or a bare number of milliseconds;
// and the bounds of a request's deadline (REQUEST_DEADLINE, `gateway keys create --deadline`),
// checked alike wherever one is given.
import * as v from 'valibot';

const UNIT_MS = { ms: 1, s: 1_000, m: 60_000, h: 3_600_000, d: 86_400_000 } as const;
const DURATION = /^(\d+)(ms|s|m|h|d)?$/;

/** The milliseconds `text` says, or undefined when it is not a duration. */
export function parseDuration(text: string): number | undefined {
  const match = DURATION.exec(text.trim());
  if (!match) return undefined;
  const ms = Number(match[1]) * UNIT_MS[(match[2] ?? 'ms') as keyof typeof UNIT_MS];
  return Number.isSafeInteger(ms) ? ms : undefined;
}

/** `ms` in the largest unit that writes it whole: 900000 is 15m, 90000 is 90s. */
export function formatDuration(ms: number): string {
  for (const unit of ['d', 'h', 'm', 's'] as const) {
    if (ms >= UNIT_MS[unit] && ms % UNIT_MS[unit] === 0) return `${ms / UNIT_MS[unit]}${unit}`;
  }
  return `${ms}ms`;
}

export const DEADLINE_MIN_MS = UNIT_MS.s;
export const DEADLINE_MAX_MS = 30 * UNIT_MS.d;

/** A duration given as `name`, from minMs to maxMs, in milliseconds. */
export const Duration = (name: string, minMs: number, maxMs: number) =>
  v.pipe(
    v.string(),
    v.check(
      (text) => parseDuration(text) !== undefined,
      `${name} must be a duration such as 24h, 15m, 90s or 500ms (or a number of milliseconds)`,
    ),
    v.transform((text) => parseDuration(text)!),
    v.minValue(minMs, `${name} must be at least ${formatDuration(minMs)}`),
    v.maxValue(maxMs, `${name} must be at most ${formatDuration(maxMs)}`),
  );

/** A request deadline given as `name`: a duration from 1s to 30d, in milliseconds. */
export const Deadline = (name: string) => Duration(name, DEADLINE_MIN_MS, DEADLINE_MAX_MS);
