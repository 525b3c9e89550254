// wait=true overhead: requests offered at a fixed rate (open loop: a slow answer delays no
// later request) with model test-delay-<ms>, so each should take that long plus whatever the
// gateway adds: storing, the worker picking the job up, claiming and recording the attempt,
// waking the waiter and reading the result. The figure is latency minus the simulated time.
import { cpuLine, type PhaseContext, type PhaseResult } from '../context.ts';
import { checks, openLoop } from '../load.ts';
import { sha256Hex } from '../signing.ts';
import { COMPLETIONS, completionBody, errorLine, ms, spreadLine } from './common.ts';

export const WAIT_TARGET = { p50: 2, p99: 10 };

export async function waitPhase(ctx: PhaseContext): Promise<PhaseResult> {
  const { waitRate, waitReferenceRate, waitDelayMs, topology } = ctx.settings;
  await ctx.start(topology);
  const model = `test-delay-${waitDelayMs}`;
  const details = [
    `${topology.map((role) => `--role ${role}`).join(' + ')}; requests on a fixed schedule, wait=true, model ${model}; ` +
      `latency from the request's write to the response's last byte, minus ${waitDelayMs} ms; ` +
      `first at ${waitReferenceRate} req/s (far from saturation: the gateway is quiet between requests), then at ${waitRate} req/s`,
  ];
  const rows = [];
  const data: Record<string, unknown> = {};
  for (const rate of [waitReferenceRate, waitRate]) {
    const measured = await measure(ctx, rate, model);
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

async function measure(ctx: PhaseContext, rate: number, model: string) {
  const { waitDelayMs, warmupMs, durationMs } = ctx.settings;
  const api = ctx.api();
  const signer = ctx.signer(api.port!);
  const body = completionBody({ wait: true, model });
  const bodySha256 = sha256Hex(body);
  const cpuWindow = ctx.cpuWindow();

  const result = await openLoop({
    port: api.port!,
    rate,
    warmupMs,
    durationMs,
    initialConnections: Math.ceil((rate * (waitDelayMs + 50)) / 1000) + 4,
    drainTimeoutMs: 60_000,
    request: () => signer.post(COMPLETIONS, body, bodySha256),
    check: checks.status(200, '"object":"chat.completion"'),
    onWindowStart: cpuWindow.onWindowStart,
    onWindowEnd: cpuWindow.onWindowEnd,
  });
  const cpu = await cpuWindow.shares();

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
