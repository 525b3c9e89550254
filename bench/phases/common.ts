// What the phases share: the request bodies, waiting for a database's requests to finish,
// and how figures are written.
import { setTimeout as sleep } from 'node:timers/promises';
import type { PhaseContext } from '../context.ts';
import type { CpuShares } from '../cpu.ts';
import type { LoadResult } from '../load.ts';

export const COMPLETIONS = '/v1/chat/completions';

/** A small, typical body: one user message, the simulator's instant model unless told. */
export function completionBody(options: { wait: boolean; model?: string; content?: string }): string {
  return JSON.stringify({
    model: options.model ?? 'test-echo',
    messages: [{ role: 'user', content: options.content ?? 'Hello from the benchmark: please echo this message.' }],
    wait: options.wait,
  });
}

/**
 * Waits until no request of the database is queued, processing or retrying, polling twice a
 * second (one cheap scan). Returns false if that did not happen within the timeout.
 */
export async function waitUntilFinished(ctx: PhaseContext, timeoutMs: number): Promise<boolean> {
  const deadline = performance.now() + timeoutMs;
  return ctx.query(async (client) => {
    for (;;) {
      const { rows } = await client.query<{ pending: boolean }>(
        `select exists (select from gateway.requests where status not in ('completed', 'failed')) as pending`,
      );
      if (!rows[0]!.pending) return true;
      if (performance.now() > deadline) return false;
      await sleep(500);
    }
  });
}

export function rate(value: number): string {
  if (!Number.isFinite(value)) return 'n/a';
  return value >= 100 ? Math.round(value).toLocaleString('en-US') : value.toFixed(1);
}

export function ms(value: number): string {
  if (!Number.isFinite(value)) return 'n/a';
  return value >= 100 ? `${Math.round(value)} ms` : value >= 10 ? `${value.toFixed(1)} ms` : `${value.toFixed(2)} ms`;
}

export function mb(bytes: number): string {
  return `${(bytes / 1024 / 1024).toFixed(1)} MB`;
}

/** "N wrong answers: HTTP 500 internal_error ×3, ..." or nothing. */
export function errorLine(result: Pick<LoadResult, 'errors'>): string | undefined {
  if (result.errors.size === 0) return undefined;
  const total = [...result.errors.values()].reduce((sum, count) => sum + count, 0);
  const kinds = [...result.errors].sort((a, b) => b[1] - a[1]).map(([kind, count]) => `${kind} ×${count}`);
  return `** ${total} failed or wrong answers in the window: ${kinds.join(', ')} **`;
}

export function spreadLine(result: LoadResult): string {
  const seconds = result.windowMs / 1000;
  return `${result.ok.toLocaleString('en-US')} correct answers in ${seconds} s; per second: lowest ${result.perSecond.min}, highest ${result.perSecond.max}`;
}

/**
 * A saturation phase's figures over its window: correct answers a second, their p50 and p99, and
 * the CPU each cost the gateway and Postgres together (undefined: not measured).
 */
export function windowFigures(result: LoadResult, cpu: CpuShares | undefined, durationMs: number) {
  const rps = result.ok / (durationMs / 1000);
  const cpuMicros = cpu && rps > 0 ? Math.round(((cpu.cores.gateway + cpu.cores.postgres) / rps) * 1e6) : undefined;
  return { rps, p50: result.latency.percentile(50), p99: result.latency.percentile(99), cpuMicros };
}
