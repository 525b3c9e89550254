// A client of the gateway under faults: every call is signed, bounded in time and never throws;
// a call that got no HTTP answer (connection refused or reset, timeout) has status 0 and says
// why. Each call keeps when it was sent and answered, so scenarios can place it on a timeline.
import type { CreatedKey } from '../../../src/keys/service.ts';
import { signature } from '../../helpers/signing.ts';

export interface Call {
  method: string;
  path: string;
  sentAt: number;
  answeredAt: number;
  /** 0 when no HTTP answer came. */
  status: number;
  headers: Headers | undefined;
  /** Parsed JSON, or the text when it is not JSON. */
  body: any;
  /** Why no answer came (status 0). */
  failure: string | undefined;
}

export interface CallOptions {
  method?: string;
  path: string;
  body?: unknown;
  key: CreatedKey;
  timeoutMs?: number;
}

export async function call(baseUrl: string, options: CallOptions): Promise<Call> {
  const body = options.body === undefined ? undefined : JSON.stringify(options.body);
  const method = options.method ?? (body === undefined ? 'GET' : 'POST');
  const headers: Record<string, string> = {
    authorization: `Bearer ${options.key.api_key}`,
    'svc-signature': signature({
      secret: options.key.signing_secret,
      method,
      path: options.path,
      ...(body === undefined ? {} : { body }),
    }),
  };
  if (body !== undefined) headers['content-type'] = 'application/json';
  const sentAt = Date.now();
  try {
    const response = await fetch(`${baseUrl}${options.path}`, {
      method,
      headers,
      ...(body === undefined ? {} : { body }),
      signal: AbortSignal.timeout(options.timeoutMs ?? 60_000),
    });
    const text = await response.text();
    let parsed: unknown = text;
    try {
      parsed = JSON.parse(text);
    } catch {}
    return {
      method,
      path: options.path,
      sentAt,
      answeredAt: Date.now(),
      status: response.status,
      headers: response.headers,
      body: parsed,
      failure: undefined,
    };
  } catch (error) {
    const cause = (error as { cause?: { code?: string; message?: string } }).cause;
    const failure = `${(error as Error).name}: ${cause?.code ?? cause?.message ?? (error as Error).message}`;
    return { method, path: options.path, sentAt, answeredAt: Date.now(), status: 0, headers: undefined, body: undefined, failure };
  }
}

/** Runs `task` in `concurrency` loops until `stop()` is called; resolves when every loop has ended. */
export function loadLoops(concurrency: number, task: (loop: number) => Promise<void>) {
  let stopped = false;
  const loops = Array.from({ length: concurrency }, async (_, loop) => {
    while (!stopped) await task(loop);
  });
  return {
    stop: async () => {
      stopped = true;
      await Promise.all(loops);
    },
  };
}

/** Counts of each value, as "value: n" sorted by value, for t.comment. */
export function tally(values: Iterable<string | number>): string {
  const counts = new Map<string, number>();
  for (const value of values) counts.set(String(value), (counts.get(String(value)) ?? 0) + 1);
  return [...counts].sort(([a], [b]) => (a < b ? -1 : 1)).map(([value, n]) => `${value}: ${n}`).join(', ') || 'none';
}

/** "min / p50 / p95 / max" of a list of milliseconds. */
export function spread(values: number[]): string {
  if (values.length === 0) return 'n/a';
  const sorted = [...values].sort((a, b) => a - b);
  const at = (q: number) => sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))]!;
  return `min ${sorted[0]} ms, p50 ${at(0.5)} ms, p95 ${at(0.95)} ms, max ${sorted.at(-1)} ms`;
}
