// Refusals: what a flood the gateway refuses costs it, the price of a careless or hostile
// client. An API process (no worker) with RATE_LIMIT_RPS=1 answers, on every connection in turn:
// a signed submission of a key over its rate (429 rate_limit_exceeded, decided before the body is
// read), a key whose checksum fails, and a key of the form without a checksum (401
// invalid_api_key, both from their text alone: no key of that form is stored). The key's rate
// admits one submission a second, answered 202 and counted apart; a 202 beyond that rate is a
// wrong answer.
import { cpuLine, type PhaseContext, type PhaseResult } from '../context.ts';
import type { HttpResponse } from '../http.ts';
import { closedLoop } from '../load.ts';
import { sha256Hex } from '../signing.ts';
import { COMPLETIONS, completionBody, errorLine, ms, rate, spreadLine, windowFigures } from './common.ts';

const RATE_LIMIT_RPS = 1;

/** Keys no gateway issued, a few of each form: with a checksum that fails, and without one. */
const FORGED_KEYS = {
  checksum: Array.from({ length: 4 }, (_, i) => `svc_test_${String(i).repeat(40)}AAAAAA`),
  noChecksum: Array.from({ length: 4 }, (_, i) => `svc_test_${String(i).repeat(40)}`),
};

export async function refusalsPhase(ctx: PhaseContext): Promise<PhaseResult> {
  const { connections, warmupMs, durationMs } = ctx.settings;
  const [api] = await ctx.start(['api'], { RATE_LIMIT_RPS: String(RATE_LIMIT_RPS) });
  const port = api!.port!;
  const signer = ctx.signer(port);
  const body = completionBody({ wait: false });
  const bodySha256 = sha256Hex(body);
  const unsigned = (key: string) =>
    `POST ${COMPLETIONS} HTTP/1.1\r\nhost: 127.0.0.1:${port}\r\nauthorization: Bearer ${key}\r\n` +
    `content-type: application/json\r\ncontent-length: ${Buffer.byteLength(body)}\r\n\r\n${body}`;
  const forged = { checksum: FORGED_KEYS.checksum.map(unsigned), noChecksum: FORGED_KEYS.noChecksum.map(unsigned) };
  const cpuWindow = ctx.cpuWindow();

  let sent = 0;
  let admitted = 0;
  const startedAt = performance.now();
  const result = await closedLoop({
    port,
    connections,
    warmupMs,
    durationMs,
    // In turn: a signed submission, a forged key of each form.
    request: () => {
      const turn = sent++;
      const round = Math.floor(turn / 3);
      if (turn % 3 === 0) return signer.post(COMPLETIONS, body, bodySha256);
      const keys = turn % 3 === 1 ? forged.checksum : forged.noChecksum;
      return keys[round % keys.length]!;
    },
    check: (response) => {
      if (response.status === 202) {
        admitted++;
        // The key's bucket starts with a burst of twice its rate and refills at its rate (one
        // more for the clocks' rounding): a 202 beyond that is a limiter that does not limit.
        const allowed = 2 * RATE_LIMIT_RPS + (RATE_LIMIT_RPS * (response.receivedAt - startedAt)) / 1000 + 1;
        return admitted <= allowed ? undefined : "HTTP 202 over the key's rate";
      }
      return refusalProblem(response);
    },
    onWindowStart: cpuWindow.onWindowStart,
    onWindowEnd: cpuWindow.onWindowEnd,
  });
  const cpu = await cpuWindow.shares();
  const stored = await ctx.storedCounts();

  const { rps, p50, p99, cpuMicros } = windowFigures(result, cpu, durationMs);
  const details = [
    `--role api (no worker), RATE_LIMIT_RPS=1, ${connections} keep-alive connections, closed loop; in turn a signed submission over its key's rate, a key failing its checksum, a key of the form without one`,
    spreadLine(result),
    cpu ? cpuLine(cpu, rps) : 'CPU: not measured',
    `${admitted.toLocaleString('en-US')} submissions admitted by the key's rate (warm-up included); stored: ${stored.requests.toLocaleString('en-US')} requests` +
      (stored.requests === admitted ? '' : '  ** MISMATCH: a refused request was stored, or an admitted one was not **'),
  ];
  const errors = errorLine(result);
  if (errors) details.push(errors);

  return {
    rows: [
      {
        figure: `refusals, 429 and 401 (API only, ${connections} connections)`,
        result: `${rate(rps)} answers/s at ${cpuMicros ?? '?'} µs of CPU each; p50 ${ms(p50)}, p99 ${ms(p99)}`,
        target: '(reference)',
        met: undefined,
      },
    ],
    details,
    data: { rps, cpuMicros, p50, p99, admitted, stored, perSecond: result.perSecond.series, errors: Object.fromEntries(result.errors), cpu: cpu?.cores },
  };
}

/** What is wrong with a refusal (undefined: it is the contract's 429 or 401). */
function refusalProblem(response: HttpResponse): string | undefined {
  const text = response.body.toString('utf8', 0, 400);
  if (response.status === 429 && text.includes('"code":"rate_limit_exceeded"')) return undefined;
  if (response.status === 401 && text.includes('"code":"invalid_api_key"')) return undefined;
  const code = /"code":"([a-z_]+)"/.exec(text)?.[1];
  return `HTTP ${response.status}${code ? ` ${code}` : ''}`;
}
