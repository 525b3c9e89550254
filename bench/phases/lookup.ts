// GET /v1/requests/{id} throughput at saturation: signed lookups of 1,000 completed requests
// (each answer carries its result), in turn, on the gateway as deployed by BENCH_TOPOLOGY.
import { cpuLine, type PhaseContext, type PhaseResult } from '../context.ts';
import { checks, closedLoop } from '../load.ts';
import { sha256Hex } from '../signing.ts';
import { COMPLETIONS, completionBody, errorLine, ms, rate, spreadLine, waitUntilFinished, windowFigures } from './common.ts';

export const LOOKUP_TARGET = 8_000;
const LOOKED_UP = 1_000;

export async function lookupPhase(ctx: PhaseContext): Promise<PhaseResult> {
  const { connections, warmupMs, durationMs, topology } = ctx.settings;
  await ctx.start(topology);
  const api = ctx.api();
  const port = api.port!;
  const signer = ctx.signer(port);

  const ids: string[] = [];
  const body = completionBody({ wait: false });
  const bodySha256 = sha256Hex(body);
  await closedLoop({
    port,
    connections: 32,
    warmupMs: 0,
    durationMs: 120_000,
    maxRequests: LOOKED_UP,
    request: () => signer.post(COMPLETIONS, body, bodySha256),
    check: checks.status(202),
    onOk: (response) => ids.push((JSON.parse(response.body.toString('utf8')) as { id: string }).id),
  });
  if (ids.length !== LOOKED_UP) throw new Error(`only ${ids.length} of ${LOOKED_UP} requests to look up were accepted`);
  if (!(await waitUntilFinished(ctx, 120_000))) throw new Error('the requests to look up did not complete within 120 s');

  let next = 0;
  const cpuWindow = ctx.cpuWindow();
  const result = await closedLoop({
    port,
    connections,
    warmupMs,
    durationMs,
    request: () => signer.get(`/v1/requests/${ids[next++ % ids.length]}`),
    check: checks.status(200, '"status":"completed"', '"result":{'),
    onWindowStart: cpuWindow.onWindowStart,
    onWindowEnd: cpuWindow.onWindowEnd,
  });
  const cpu = await cpuWindow.shares();

  const { rps, p50, p99 } = windowFigures(result, cpu, durationMs);
  const details = [
    `${topology.map((role) => `--role ${role}`).join(' + ')}; ${connections} connections, closed loop, ` +
      `each a signed GET of one of ${LOOKED_UP.toLocaleString('en-US')} completed requests in turn`,
    spreadLine(result),
    cpu ? cpuLine(cpu, rps) : 'CPU: not measured',
  ];
  const errors = errorLine(result);
  if (errors) details.push(errors);
  return {
    rows: [
      {
        figure: `lookups, GET /v1/requests/{id} (${connections} connections)`,
        result: `${rate(rps)} req/s; p50 ${ms(p50)}, p99 ${ms(p99)}`,
        target: `≥ ${LOOKUP_TARGET.toLocaleString('en-US')} req/s`,
        met: rps >= LOOKUP_TARGET && result.errors.size === 0,
      },
    ],
    details,
    data: { rps, p50, p99, perSecond: result.perSecond.series, errors: Object.fromEntries(result.errors), cpu: cpu?.cores },
  };
}
