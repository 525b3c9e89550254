// wait=true overhead: requests offered at a fixed rate (open loop: a slow answer delays no
// later request) with model test-delay-<ms>, so each should take that long plus whatever the
// gateway adds: storing, the worker picking the job up, claiming and recording the attempt,
// waking the waiter and reading the result. The figure is latency minus the simulated time.
import { randomBytes } from 'node:crypto';
import { cpuLine, type PhaseContext, type PhaseResult } from '../context.ts';
import type { GatewayProcess } from '../gateway.ts';
import { checks, openLoop } from '../load.ts';
import { sha256Hex } from '../signing.ts';
import { COMPLETIONS, completionBody, errorLine, ms, spreadLine } from './common.ts';

export const WAIT_TARGET = { p50: 2, p99: 10 };

export async function waitPhase(ctx: PhaseContext): Promise<PhaseResult> {
  const { waitRate, waitReferenceRate, waitDelayMs, topology } = ctx.settings;
  // The token puts each process's /metrics on its PORT: their timing of the durable writes is read.
  const metricsToken = randomBytes(16).toString('hex');
  const processes = await ctx.start(topology, { METRICS_TOKEN: metricsToken });
  const writes = () => durableWrites(processes, metricsToken).catch(() => undefined);
  const model = `test-delay-${waitDelayMs}`;
  const details = [
    `${topology.map((role) => `--role ${role}`).join(' + ')}; requests on a fixed schedule, wait=true, model ${model}; ` +
      `latency from the request's write to the response's last byte, minus ${waitDelayMs} ms; ` +
      `first at ${waitReferenceRate} req/s (far from saturation: the gateway is quiet between requests), then at ${waitRate} req/s`,
  ];
  const rows = [];
  const data: Record<string, unknown> = {};
  for (const rate of [waitReferenceRate, waitRate]) {
    const measured = await measure(ctx, rate, model, writes);
    details.push(...measured.details.map((line) => `at ${rate} req/s: ${line}`));
    rows.push({
      figure: `wait=true overhead at ${rate} req/s (${model})`,
      result: `p50 ${ms(measured.p50)}, p99 ${ms(measured.p99)}`,
      target: `p50 ≤ ${WAIT_TARGET.p50} ms, p99 ≤ ${WAIT_TARGET.p99} ms`,
      met: measured.p50 <= WAIT_TARGET.p50 && measured.p99 <= WAIT_TARGET.p99 && measured.errors === 0,
    });
    data[`rate${rate}`] = measured.data;
  }
  // The busier rate first.
  return { rows: rows.reverse(), details, data };
}

async function measure(ctx: PhaseContext, rate: number, model: string, writes: () => Promise<DurableWrites | undefined>) {
  const { waitDelayMs, warmupMs, durationMs } = ctx.settings;
  const api = ctx.api();
  const signer = ctx.signer(api.port!);
  const body = completionBody({ wait: true, model });
  const bodySha256 = sha256Hex(body);
  const cpuWindow = ctx.cpuWindow();
  let writesBefore: Promise<DurableWrites | undefined> | undefined;
  let writesAfter: Promise<DurableWrites | undefined> | undefined;

  const result = await openLoop({
    port: api.port!,
    rate,
    warmupMs,
    durationMs,
    initialConnections: Math.ceil((rate * (waitDelayMs + 50)) / 1000) + 4,
    drainTimeoutMs: 60_000,
    request: () => signer.post(COMPLETIONS, body, bodySha256),
    check: checks.status(200, '"object":"chat.completion"'),
    onWindowStart: () => {
      cpuWindow.onWindowStart();
      writesBefore = writes();
    },
    onWindowEnd: () => {
      cpuWindow.onWindowEnd();
      writesAfter = writes();
    },
  });
  const cpu = await cpuWindow.shares();
  const [before, after] = await Promise.all([writesBefore, writesAfter]);

  // Subtracting a constant keeps every rank: the overhead's percentiles are the latency's, less the delay.
  const latencies = result.latency;
  const count = latencies.count;
  const p50 = latencies.percentile(50) - waitDelayMs;
  const p90 = latencies.percentile(90) - waitDelayMs;
  const p99 = latencies.percentile(99) - waitDelayMs;
  const max = latencies.max - waitDelayMs;
  const min = latencies.percentile(0) - waitDelayMs;
  const lagP99 = result.sendLag.percentile(99);

  const details = [
    `${count.toLocaleString('en-US')} answered correctly of those scheduled in the window; overhead min ${ms(min)}, p50 ${ms(p50)}, p90 ${ms(p90)}, p99 ${ms(p99)}, max ${ms(max)}`,
    spreadLine(result) +
      (result.ok < 0.95 * rate * (durationMs / 1000)
        ? `  ** fewer than the ${rate}/s offered were answered correctly in time: the gateway is over capacity, and the overhead is mostly queueing **`
        : ''),
    `load generator: ${result.connections} connections; requests written p99 ${ms(lagP99)} after their scheduled time ` +
      '(timer and CPU-scheduling delays of the generator, or waits for a new connection)' +
      (lagP99 > 10 ? '  ** the generator fell behind its schedule **' : ''),
    cpu ? cpuLine(cpu, result.ok / (durationMs / 1000)) : 'CPU: not measured',
    writesLine(before, after),
  ];
  const errors = errorLine(result);
  if (errors) details.push(errors);
  const errorCount = [...result.errors.values()].reduce((sum, n) => sum + n, 0);
  return {
    p50,
    p99,
    errors: errorCount,
    details,
    data: { p50, p90, p99, min, max, count, sendLagP99: lagP99, errors: Object.fromEntries(result.errors), cpu: cpu?.cores },
  };
}

/** Each durable write's count and total seconds, summed over the gateway's processes. */
type DurableWrites = Record<'accept' | 'finish', { count: number; seconds: number }>;

/** The gateway's own timing of its durable writes (gateway_db_write_duration_seconds) so far. */
async function durableWrites(processes: GatewayProcess[], token: string): Promise<DurableWrites> {
  const totals: DurableWrites = { accept: { count: 0, seconds: 0 }, finish: { count: 0, seconds: 0 } };
  for (const gateway of processes) {
    const answer = await fetch(`http://127.0.0.1:${gateway.port}/metrics`, { headers: { authorization: `Bearer ${token}` } });
    const text = await answer.text();
    for (const write of ['accept', 'finish'] as const) {
      const sample = (kind: string) =>
        Number(new RegExp(`^gateway_db_write_duration_seconds_${kind}\\{write="${write}"\\} (\\S+)$`, 'm').exec(text)?.[1] ?? 0);
      totals[write].count += sample('count');
      totals[write].seconds += sample('sum');
    }
  }
  return totals;
}

/** The window's durable writes: how many, and how long each took on average, as the gateway timed them. */
function writesLine(before: DurableWrites | undefined, after: DurableWrites | undefined): string {
  if (!before || !after) return "the gateway's durable writes: not read (its /metrics did not answer)";
  const part = (write: 'accept' | 'finish') => {
    const count = after[write].count - before[write].count;
    const seconds = after[write].seconds - before[write].seconds;
    return `${write} ${count.toLocaleString('en-US')}, mean ${count ? ms((seconds / count) * 1000) : 'n/a'}`;
  };
  return `the gateway's durable writes in the window, from asking the pool for a connection to the commit flushed (gateway_db_write_duration_seconds): ${part('accept')}; ${part('finish')}`;
}
