// Accept throughput: wait=false submissions at saturation against an API process with no
// worker, so that nothing else competes for the CPU and the figure is the accept path alone
// (request row, nonce and job committed, then the 202), comparable with the pgbench ceiling.
import { cpuLine, type PhaseContext, type PhaseResult } from '../context.ts';
import { checks, closedLoop } from '../load.ts';
import { sha256Hex } from '../signing.ts';
import { COMPLETIONS, completionBody, errorLine, ms, rate, spreadLine, windowFigures } from './common.ts';

export const ACCEPT_TARGET = { rps: 8_000, cpuMicros: 150 };

export async function acceptPhase(ctx: PhaseContext): Promise<PhaseResult> {
  const { connections, warmupMs, durationMs } = ctx.settings;
  const [api] = await ctx.start(['api']);
  const signer = ctx.signer(api!.port!);
  const body = completionBody({ wait: false });
  const bodySha256 = sha256Hex(body);
  const cpuWindow = ctx.cpuWindow();

  const result = await closedLoop({
    port: api!.port!,
    connections,
    warmupMs,
    durationMs,
    request: () => signer.post(COMPLETIONS, body, bodySha256),
    check: checks.status(202, '"object":"chat.completion.async"', '"status":"queued"'),
    onWindowStart: cpuWindow.onWindowStart,
    onWindowEnd: cpuWindow.onWindowEnd,
  });
  const cpu = await cpuWindow.shares();

  // Every acknowledgement must stand for a stored request (and nothing else), each statement
  // having woken the lane with one job at most.
  const stored = await ctx.storedCounts();

  const { rps, p50, p99, cpuMicros } = windowFigures(result, cpu, durationMs);
  const consistent = stored.requests === result.totalOk && stored.jobs <= result.totalOk;
  const details = [
    `--role api (no worker), ${connections} keep-alive connections, closed loop; wait=false, model test-echo`,
    spreadLine(result),
    cpu ? cpuLine(cpu, rps) : 'CPU: not measured',
    `${result.totalOk.toLocaleString('en-US')} acknowledged (warm-up included); stored: ${stored.requests.toLocaleString('en-US')} requests, ` +
      `${stored.jobs.toLocaleString('en-US')} dispatch jobs (one per insert statement)` +
      (consistent ? '' : '  ** MISMATCH: every acknowledgement should be exactly one request, with a job per statement at most **'),
  ];
  const errors = errorLine(result);
  if (errors) details.push(errors);

  return {
    rows: [
      {
        figure: `accept, wait=false (API only, ${connections} connections)`,
        result: `${rate(rps)} req/s at ${cpuMicros ?? '?'} µs of CPU each; p50 ${ms(p50)}, p99 ${ms(p99)}`,
        target: `≥ ${ACCEPT_TARGET.rps.toLocaleString('en-US')} req/s at ≤ ${ACCEPT_TARGET.cpuMicros} µs (gateway + Postgres)`,
        met: rps >= ACCEPT_TARGET.rps && cpuMicros !== undefined && cpuMicros <= ACCEPT_TARGET.cpuMicros && result.errors.size === 0,
      },
    ],
    details,
    data: { rps, cpuMicros, p50, p99, perSecond: result.perSecond.series, errors: Object.fromEntries(result.errors), stored, acknowledged: result.totalOk, cpu: cpu?.cores },
  };
}
