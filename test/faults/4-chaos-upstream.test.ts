// Fault 4: 1,000 live-mode requests against an upstream that fails at random (429 with
// retry-after, 5xx, other 4xx, resets, hangs past the upstream timeout, garbage 2xx bodies).
// Every request must end, and each of its attempts with the code of what the upstream actually
// answered that attempt: retried while the code is retryable and fewer than MAX_ATTEMPTS were
// charged to it (a 429 never is, the request's own fault always is; the provider's failures as
// the lane's health has it), completed with the upstream's completion verbatim. Failing most of
// its calls, the lane opens and closes as it goes.
import { randomInt } from 'node:crypto';
import { isDeepStrictEqual } from 'node:util';
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { BEHAVIOURS, chaos, RETRYABLE, type ChaosCall } from './support/chaos.ts';
import { inBatches } from '../helpers/concurrency.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { call, spread, tally } from './support/client.ts';
import { faultContext } from './support/context.ts';
import { queueSummary, requestsWithAttempts, waitUntilTerminal, type RequestWithAttempts } from './support/rows.ts';
import { privateContent, UPSTREAM_API_KEY } from './support/run.ts';

const REQUESTS = 1_000;
const MAX_ATTEMPTS = 5;
const UPSTREAM_TIMEOUT_MS = 1_500;
// How long before the upstream timeout an answer may come and still be seen after it (below).
const EVENT_LOOP_SLACK_MS = 250;

t.test('1,000 requests against an upstream that fails at random: all end, each attempt with the code of what the upstream answered it', async (t) => {
  const seed = randomInt(2 ** 31);
  t.comment(`chaos seed ${seed}`);
  const script = chaos({
    seed,
    tagOf: (body) => /scenario 4 request (\d+) /.exec(body?.messages?.[0]?.content ?? '')?.[1] ?? 'unknown',
  });
  const upstream = await startFakeUpstream(t, script.reply);
  const faults = await faultContext(t, '4-chaos-upstream');
  const env = {
    UPSTREAM_BASE_URL: upstream.baseUrl,
    UPSTREAM_TIMEOUT_MS: String(UPSTREAM_TIMEOUT_MS),
    MAX_ATTEMPTS: String(MAX_ATTEMPTS),
    RETRY_BASE_MS: '20',
    RETRY_MAX_MS: '200',
    WORKER_CONCURRENCY: '64',
  };
  const api = await faults.start('api', { env });
  const key = await faults.createKey({ project: 'faults-chaos', mode: 'live' });
  const worker = await faults.process('worker', { env });

  const startedAt = Date.now();
  const accepted = await inBatches(Array.from({ length: REQUESTS }, (_, i) => i), 50, (i) =>
    call(api.url!, {
      path: '/v1/chat/completions',
      key,
      body: {
        model: 'gpt-chaos',
        messages: [{ role: 'user', content: privateContent(`scenario 4 request ${i}`) }],
        temperature: 0.5,
        wait: false,
        idempotency_key: `chaos-${i}`,
        stream: false,
      },
    }),
  );
  t.same(tally(accepted.map((answer) => answer.status)), `202: ${REQUESTS}`, 'all 1,000 acknowledged');
  const ids = accepted.map((answer) => answer.body.id as string);
  // The worker starts once all are in, so that the submissions do not slow this process's
  // upstream down past the gateway's timeout.
  await worker.start();

  // An upstream failing about half its calls opens its lane now and then (lane health): only
  // probes start then, up to 15 s apart, so the last requests may take minutes to end.
  const ended = await waitUntilTerminal(faults.pool, ids, 240_000);
  t.ok(ended.done, `all ended (left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);
  if (!ended.done) t.comment(await queueSummary(faults.pool));
  t.comment(`all ended ${Date.now() - startedAt} ms after the first was sent`);
  // A call after the end would show up here.
  await sleep(2_000);

  const requests = await requestsWithAttempts(faults.pool, ids);
  const byId = new Map(requests.map((request) => [request.id, request]));
  const problems: string[] = [];
  let late = 0;
  ids.forEach((id, i) => {
    const request = byId.get(id);
    if (!request) return problems.push(`request ${i} (${id}) is not stored`);
    const checked = crossCheck(request, script.callsFor(String(i)));
    late += checked.late;
    problems.push(...checked.problems.map((problem) => `request ${i} (${id}): ${problem}`));
  });
  t.comment(`${late} calls were answered by this process only after the gateway's ${UPSTREAM_TIMEOUT_MS} ms upstream timeout (expected: upstream_timeout)`);
  t.same(problems.slice(0, 20), [], `every request's attempts and outcome follow from what the upstream answered (${problems.length} problems)`);
  t.ok(requests.every((request) => request.charged_attempts <= MAX_ATTEMPTS), 'no request was charged more than MAX_ATTEMPTS attempts');
  const changes = worker.entries().filter((line) => line.msg === 'lane health changed');
  t.comment(`the lane changed health ${changes.length} times; attempts charged: ${tally(requests.flatMap((request) => request.attempt_rows.map((attempt) => String(attempt.charged))))}`);
  t.equal(upstream.calls.length, requests.reduce((sum, request) => sum + request.attempts, 0), 'one upstream call per attempt, none after a request ended');
  t.same(script.calls.filter((chaos) => chaos.tag === 'unknown').length, 0, 'every call was for one of the requests');

  t.same(
    tally(upstream.calls.map((received) => String(received.headers.authorization === `Bearer ${UPSTREAM_API_KEY}`))),
    `true: ${upstream.calls.length}`,
    'every call carried UPSTREAM_API_KEY',
  );
  t.same(
    upstream.calls.filter((received) => Object.keys(received.body).sort().join(',') !== 'messages,model,temperature').map((received) => Object.keys(received.body)).slice(0, 5),
    [],
    'and the body without wait, idempotency_key and stream',
  );

  // What clients see: the lookup record agrees with the rows.
  const records = await inBatches(ids, 50, (id) => call(api.url!, { path: `/v1/requests/${id}`, key }));
  t.same(
    records.filter((record) => {
      const row = byId.get(record.body?.id);
      return record.status !== 200 || !row || record.body.status !== row.status || record.body.attempts !== row.attempts ||
        record.body.last_error_code !== row.last_error_code || ('result' in record.body) !== (row.status === 'completed');
    }).map((record) => [record.status, record.body]).slice(0, 5),
    [],
    'every lookup answers the request as stored: status, attempts, last_error_code, result when completed',
  );

  t.comment(`upstream calls: ${upstream.calls.length}: ${tally(script.calls.map((chaos) => chaos.behaviour))}`);
  t.comment(`requests: ${tally(requests.map((request) => request.status))}; attempts: ${tally(requests.map((request) => request.attempts))}`);
  t.comment(`failed with: ${tally(requests.filter((request) => request.status === 'failed').map((request) => request.last_error_code ?? 'null'))}`);
  t.comment(`completed after errors, last_error_code: ${tally(requests.filter((request) => request.status === 'completed' && request.last_error_code).map((request) => request.last_error_code!))}`);
  t.comment(`time from acknowledgement to end: ${spread(requests.map((request) => (request.finished_at?.getTime() ?? Date.now()) - request.created_at.getTime()))}`);

  await faults.finish(t);
});

/** How a request's rows disagree with what the upstream answered each of its calls. */
function crossCheck(request: RequestWithAttempts, calls: ChaosCall[]): { problems: string[]; late: number } {
  const problems: string[] = [];
  let late = 0;
  const expected: (string | null)[] = calls.map((chaos) => BEHAVIOURS[chaos.behaviour].code);
  const answered = calls.map((chaos) => `${chaos.behaviour}${chaos.received.status === undefined ? '' : ` ${chaos.received.status}`}`).join(', ');
  if (request.attempts !== calls.length) problems.push(`${request.attempts} attempts, but the upstream had ${calls.length} calls (${answered})`);
  request.attempt_rows.forEach((attempt, index) => {
    const chaos = calls[index];
    let code = expected[index];
    if (code === undefined || !chaos) return;
    // This process answered after the gateway's timeout had passed (it was starved of CPU; the
    // answer goes out as the call's body arrives, a reset mid-body 5 ms after its first bytes):
    // what the gateway saw was no answer in time. The answer's time is when it ended (its last
    // byte sent, or its connection reset). The gateway's timer starts with its call, which is
    // after the attempt's started_at (the row is written first; on a busy machine, a second or
    // more before) and before this process received the call. An answer ended sooner than the
    // timeout counted from started_at was in time; a later one may have been, or not: the gateway
    // alone knows which of the two it saw. So may one that ended just before the deadline, and
    // reached a worker whose event loop was held up (two busy cores) only after it: by as much as
    // the attempt's own timer fired late (its duration_ms past the timeout), a timer coming before
    // the socket's news in a turn of a late loop.
    const answeredAt = chaos.received.endedAt ?? Number.POSITIVE_INFINITY;
    const timerLateMs = attempt.error_code === 'upstream_timeout' ? Math.max(0, (attempt.duration_ms ?? 0) - UPSTREAM_TIMEOUT_MS) : 0;
    const lateFromStart = answeredAt >= attempt.started_at.getTime() + UPSTREAM_TIMEOUT_MS - EVENT_LOOP_SLACK_MS - timerLateMs;
    if (lateFromStart && attempt.error_code === 'upstream_timeout' && code !== 'upstream_timeout') {
      code = expected[index] = 'upstream_timeout';
      late += 1;
    }
    const wanted = code === null ? { outcome: 'succeeded', error_code: null } : { outcome: 'failed', error_code: code };
    if (attempt.outcome !== wanted.outcome || attempt.error_code !== wanted.error_code) {
      problems.push(`attempt ${index + 1} ended ${attempt.outcome} ${attempt.error_code} (${attempt.error_detail}, after ${attempt.duration_ms} ms), but the upstream answered ${answered.split(', ')[index]} (expected ${wanted.outcome} ${wanted.error_code})`);
    }
    // Whose fault: a 429 is never charged, the request's own fault always, a success is not a charge.
    const charge = code === null ? null : code === 'upstream_rate_limited' ? false : code === 'upstream_bad_request' ? true : undefined;
    if (charge !== undefined && attempt.charged !== charge) problems.push(`attempt ${index + 1} (${code}) charged ${attempt.charged}`);
  });
  const charged = request.attempt_rows.filter((attempt) => attempt.charged).length;
  if (request.charged_attempts !== charged) problems.push(`charged_attempts ${request.charged_attempts}, but ${charged} attempts say they were charged`);
  const last = expected.at(-1);
  const earlier = expected.slice(0, -1);
  if (earlier.some((code) => code === null || !RETRYABLE.has(code))) problems.push(`retried after a success or a non-retryable error: ${answered}`);
  if (last === null) {
    if (request.status !== 'completed') problems.push(`${request.status}, but the last call was answered with a completion`);
    else if (!isDeepStrictEqual(request.result, calls.at(-1)?.completion)) problems.push('completed, but not with the completion the upstream sent');
  } else if (last !== undefined) {
    if (request.status !== 'failed') problems.push(`${request.status}, but the last call failed (${answered})`);
    if (RETRYABLE.has(last) && charged < MAX_ATTEMPTS) problems.push(`failed after ${charged} charged attempts with retryable ${last}`);
  }
  const lastFailure = expected.filter((code) => code !== null).at(-1) ?? null;
  if (request.last_error_code !== lastFailure) problems.push(`last_error_code ${request.last_error_code}, but the last failed call says ${lastFailure} (${answered})`);
  return { problems, late };
}
