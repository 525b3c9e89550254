// End-to-end throughput: how many requests per second the whole gateway (API and worker, as
// deployed by BENCH_TOPOLOGY) takes from submission to `completed`. A burst of wait=false
// submissions at saturation for the measured window, then no more: the figure is the number
// completed divided by the time from the first one's created_at to the last one's finished_at,
// both read from the database. All the work of the burst is inside that time whichever part
// (API or worker) is faster, so the figure cannot be raised by starving one for the other.
import { cpuLine, type PhaseContext, type PhaseResult } from '../context.ts';
import type { CpuShares } from '../cpu.ts';
import { checks, closedLoop } from '../load.ts';
import { sha256Hex } from '../signing.ts';
import { COMPLETIONS, completionBody, errorLine, ms, rate, waitUntilFinished } from './common.ts';

export const END_TO_END_TARGET = 2_000;
const DRAIN_TIMEOUT_MS = 120_000;

export async function endToEndPhase(ctx: PhaseContext): Promise<PhaseResult> {
  const { connections, warmupMs, durationMs, topology } = ctx.settings;
  await ctx.start(topology);
  const api = ctx.api();
  const signer = ctx.signer(api.port!);
  const body = completionBody({ wait: false });
  const bodySha256 = sha256Hex(body);
  const submit = (seconds: number) =>
    closedLoop({
      port: api.port!,
      connections,
      warmupMs: 0,
      durationMs: seconds,
      request: () => signer.post(COMPLETIONS, body, bodySha256),
      check: checks.status(202, '"object":"chat.completion.async"'),
    });

  const details = [
    `${topology.map((role) => `--role ${role}`).join(' + ')}; ${connections} connections submit wait=false (model test-echo) ` +
      `for ${durationMs / 1000} s, then the gateway finishes them; rate = completed / (last finished_at - first created_at)`,
  ];
  if (warmupMs > 0) {
    await submit(warmupMs);
    if (!(await waitUntilFinished(ctx, DRAIN_TIMEOUT_MS))) details.push('** the warm-up burst did not finish in time **');
  }

  const since = await ctx.query(async (client) => (await client.query<{ now: Date }>('select now()')).rows[0]!.now);
  const meter = ctx.cpuMeter();
  const started = performance.now();
  const burst = await submit(durationMs);
  const submittedIn = performance.now() - started;
  const finished = await waitUntilFinished(ctx, DRAIN_TIMEOUT_MS);
  const drainedIn = performance.now() - started - submittedIn;
  const cpu: CpuShares = await meter.end();

  const outcome = await ctx.query(async (client) => {
    const { rows } = await client.query<{
      total: string;
      completed: string;
      failed: string;
      seconds: number | null;
      p50: number | null;
      p99: number | null;
    }>(
      `select count(*) as total,
              count(*) filter (where status = 'completed') as completed,
              count(*) filter (where status = 'failed') as failed,
              extract(epoch from max(finished_at) - min(created_at))::float8 as seconds,
              percentile_cont(0.5) within group (order by extract(epoch from finished_at - created_at))::float8 * 1000 as p50,
              percentile_cont(0.99) within group (order by extract(epoch from finished_at - created_at))::float8 * 1000 as p99
       from gateway.requests where created_at >= $1`,
      [since],
    );
    const row = rows[0]!;
    return {
      total: Number(row.total),
      completed: Number(row.completed),
      failed: Number(row.failed),
      seconds: row.seconds ?? Number.NaN,
      p50: row.p50 ?? Number.NaN,
      p99: row.p99 ?? Number.NaN,
    };
  });
  const completionsPerSecond = outcome.completed / outcome.seconds;
  const submitRate = burst.totalOk / (submittedIn / 1000);
  details.push(
    `${burst.totalOk.toLocaleString('en-US')} submitted at ${rate(submitRate)} req/s; the last finished ${(drainedIn / 1000).toFixed(1)} s after the submissions stopped; ` +
      `time in the gateway (created_at to finished_at): p50 ${ms(outcome.p50)}, p99 ${ms(outcome.p99)} (mostly queueing: a burst)`,
    cpuLine(cpu, outcome.completed / cpu.seconds),
  );
  if (!finished) details.push(`** not all finished within ${DRAIN_TIMEOUT_MS / 1000} s of the end of the burst: the figure counts those that did **`);
  if (outcome.total !== burst.totalOk || outcome.completed !== outcome.total) {
    details.push(
      `** ${burst.totalOk} acknowledged, but ${outcome.total} stored of which ${outcome.completed} completed and ${outcome.failed} failed **`,
    );
  }
  const errors = errorLine(burst);
  if (errors) details.push(errors);

  return {
    rows: [
      {
        figure: `end-to-end, submitted to completed (${topology.join('+')})`,
        result: `${rate(completionsPerSecond)} completions/s`,
        target: `≥ ${END_TO_END_TARGET.toLocaleString('en-US')} /s`,
        met: completionsPerSecond >= END_TO_END_TARGET && finished && outcome.failed === 0,
      },
    ],
    details,
    data: { completionsPerSecond, submitRate, drainedInMs: drainedIn, ...outcome, finished, cpu: cpu.cores },
  };
}
