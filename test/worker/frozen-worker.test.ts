// A worker frozen past WORKER_DEAD_AFTER_MS with work under way, as a long pause of its machine
// or of its process does (SIGSTOP here), while another worker stands by, then resumed (SIGCONT).
// The other worker takes it for dead, and hands its work back. Once resumed, the frozen worker
// gets the answers of what it had under way, late, and must record none of them:
// - its upstream calls: the other worker records their attempts as worker_lost and calls again.
//   The late answers come while those second calls are still under way; every request then
//   completes once, with the answer of its second attempt and one webhook event; and the resumed
//   worker goes on working, alone once the other has stopped;
// - its webhook tries: the other worker records them as failed and tries again, with the same
//   webhook-id. The late 2xx answers change nothing of the messages, each delivered by its second
//   try.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { call, tally } from '../faults/support/client.ts';
import { faultContext } from '../faults/support/context.ts';
import { lifecycleProblems, queueSummary, requestsWithAttempts, waitUntilTerminal } from '../faults/support/rows.ts';
import { privateContent } from '../faults/support/run.ts';
import { dispatchJobs } from '../helpers/rows.ts';
import { parseLine } from '../helpers/serve.ts';
import { completionFor, startFakeUpstream, type ReceivedCall } from '../helpers/upstream.ts';
import { waitFor } from '../helpers/wait.ts';
import { messagesOf, startReceiver, triesOf } from '../webhooks/support.ts';

const SCENARIO = 'worker-frozen';
const REQUESTS = 40;
const MAX_ATTEMPTS = 5;
// Long enough that the worker left running, beating every fifth of it, is never taken for dead by
// a stall of its own on a busy machine (the frozen one, resumed, sweeps too).
const DEAD_AFTER_MS = 4_000;
// What a worker logs, at debug level, once it has gone to record an attempt that succeeded
// (src/worker/attempts.ts), and a webhook try that was answered 2xx (src/webhooks/deliverer.ts).
const SUCCEEDED = 'attempt succeeded';
const DELIVERED = 'webhook delivered';
// Webhook tries under way when the worker is frozen: at most WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT (10).
const TRIES = 10;

/** How many lines of the process's log have this message, and `stale: true`. */
const staleLines = (lines: readonly string[], msg: string) =>
  lines.filter((line) => {
    const entry = parseLine(line);
    return entry?.msg === msg && entry.stale === true;
  }).length;

/** A completion whose content says which call of its request answered it. */
const completionSaying = (call: ReceivedCall, which: 'late' | 'again') => {
  const completion = completionFor(call.body);
  completion.choices[0]!.message.content = `${which}: ${call.content}`;
  return { status: 200, json: completion };
};

t.test('a worker frozen past WORKER_DEAD_AFTER_MS with its calls under way, then resumed while they run again elsewhere: its late answers are recorded nowhere, each request completes once', async (t) => {
  // Each request's first call is answered "late" once the frozen worker is resumed; its second
  // "again", once the late answers have been seen.
  const release = { first: () => {}, second: () => {} };
  const firstReleased = new Promise<void>((resolve) => (release.first = resolve));
  const secondReleased = new Promise<void>((resolve) => (release.second = resolve));
  const called = new Set<string>();
  const upstream = await startFakeUpstream(t, async (call) => {
    if (called.has(call.content)) {
      await secondReleased;
      return completionSaying(call, 'again');
    }
    called.add(call.content);
    await firstReleased;
    return completionSaying(call, 'late');
  });
  const receiver = await startReceiver(t);
  const faults = await faultContext(t, SCENARIO);
  const env = {
    UPSTREAM_BASE_URL: upstream.baseUrl,
    UPSTREAM_TIMEOUT_MS: '60000',
    MAX_ATTEMPTS: String(MAX_ATTEMPTS),
    WORKER_DEAD_AFTER_MS: String(DEAD_AFTER_MS),
    SHUTDOWN_GRACE_MS: '1000',
    WEBHOOK_ALLOW_PRIVATE: 'true',
  };
  const api = await faults.start('api', { env });
  const project = 'worker-frozen';
  const key = await faults.createKey({ project, mode: 'live' });
  receiver.secrets.push((await faults.addEndpoint({ project, url: receiver.url })).secret);

  const post = (i: number) =>
    call(api.url!, { path: '/v1/chat/completions', key, body: { model: 'gpt-frozen', messages: [{ role: 'user', content: privateContent(`frozen ${i}`) }] } });
  const accepted = await Promise.all(Array.from({ length: REQUESTS }, (_, i) => post(i)));
  t.equal(tally(accepted.map((answer) => answer.status)), `202: ${REQUESTS}`, `all ${REQUESTS} acknowledged`);
  const ids = accepted.map((answer) => answer.body.id as string);

  // The first worker takes every call; the second starts once they are all under way.
  // (At debug level, its log says which outcomes it found recorded already: src/worker/attempts.ts.)
  const frozen = await faults.start('worker', { label: 'worker-frozen', env: { ...env, LOG_LEVEL: 'debug' } });
  t.ok(await waitFor(() => upstream.calls.length >= REQUESTS, 30_000), `the first worker has all ${REQUESTS} calls under way`);
  const other = await faults.start('worker', { label: 'worker-other', env });
  const { rows: running } = await faults.pool.query<{ worker_id: string }>(`select distinct worker_id from gateway.request_attempts where outcome = 'running'`);
  t.equal(running.length, 1, 'all of them in the first worker');
  const frozenId = running[0]!.worker_id;

  frozen.signal('SIGSTOP');
  t.teardown(() => frozen.signal('SIGCONT'));
  const retried = await waitFor(() => upstream.calls.length >= 2 * REQUESTS, 30_000);
  t.ok(retried, `while the first worker is frozen, the other runs every request again (${upstream.calls.length - REQUESTS} calls)`);
  if (!retried) t.comment(await queueSummary(faults.pool));

  // Resumed while the second attempts run: its calls are answered now, late, and it would record them.
  frozen.signal('SIGCONT');
  release.first();
  const firstCalls = upstream.calls.slice(0, REQUESTS);
  t.ok(await waitFor(() => firstCalls.every((call) => call.endedAt !== undefined), 10_000), 'the late answers reached the resumed worker');
  await waitFor(() => staleLines(frozen.lines, SUCCEEDED) >= REQUESTS, 15_000);
  t.equal(staleLines(frozen.lines, SUCCEEDED), REQUESTS, 'the resumed worker went to record each late answer, and found its attempt recorded already');
  const meanwhile = await requestsWithAttempts(faults.pool, ids);
  t.same(
    meanwhile
      .filter((request) => {
        const [first, second] = request.attempt_rows;
        return !(request.status === 'processing' && first?.error_code === 'worker_lost' && second?.outcome === 'running');
      })
      .map((request) => `${request.id}: ${request.status}, ${request.attempt_rows.map((attempt) => `${attempt.outcome} ${attempt.error_code ?? ''}`).join(', ')}`)
      .slice(0, 20),
    [],
    'the late answers changed nothing: each request still runs its second attempt, its first recorded as worker_lost',
  );

  release.second();
  const ended = await waitUntilTerminal(faults.pool, ids, 30_000);
  t.ok(ended.done, `all ended (left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);
  if (!ended.done) t.comment(await queueSummary(faults.pool));

  const requests = await requestsWithAttempts(faults.pool, ids);
  const problems = requests.flatMap((request) => lifecycleProblems(request, MAX_ATTEMPTS).map((problem) => `${request.id}: ${problem}`));
  t.same(problems.slice(0, 20), [], 'every request completed by the rules: one succeeded attempt, its last, none running');
  t.same(
    requests
      .filter((request) => {
        const [first, second] = request.attempt_rows;
        return !(
          request.attempt_rows.length === 2 &&
          first?.worker_id === frozenId && first.outcome === 'failed' && first.error_code === 'worker_lost' &&
          second?.worker_id !== frozenId && second?.outcome === 'succeeded'
        );
      })
      .map((request) => `${request.id}: ${request.attempt_rows.map((attempt) => `${attempt.outcome} ${attempt.error_code ?? ''} by ${attempt.worker_id === frozenId ? 'the frozen worker' : 'the other'}`).join(', ')}`)
      .slice(0, 20),
    [],
    "each: the frozen worker's attempt recorded as worker_lost, then one by the other worker that succeeded",
  );
  t.same(
    requests.filter((request) => !String(request.result?.choices?.[0]?.message?.content).startsWith('again: ')).map((request) => request.id).slice(0, 20),
    [],
    "each request's result is its second call's answer, not the late one",
  );

  const events = await waitFor(() => new Set(receiver.deliveries.map((delivery) => delivery.headers['webhook-id'])).size >= REQUESTS, 15_000);
  t.ok(events, 'an event for each request');
  // Time for a second event of a request, were there one.
  await sleep(500);
  const byRequest = new Map<string, string[]>();
  for (const delivery of receiver.deliveries) {
    const id = String(delivery.event?.data.id);
    byRequest.set(id, [...(byRequest.get(id) ?? []), `${delivery.event?.type} ${delivery.headers['webhook-id']}`]);
  }
  t.same(
    ids.filter((id) => new Set(byRequest.get(id)).size !== 1 || !byRequest.get(id)![0]!.startsWith('request.completed ')).map((id) => `${id}: ${byRequest.get(id)?.join(', ')}`),
    [],
    'one event per request: request.completed',
  );
  t.ok(receiver.deliveries.every((delivery) => delivery.verifiedWith.length === 1), 'every delivery verified');

  // The resumed worker goes on working: alone, once the other has stopped, it runs new requests.
  await other.stop();
  const more = await Promise.all(Array.from({ length: 5 }, (_, i) => post(REQUESTS + i)));
  const moreIds = more.map((answer) => answer.body.id as string);
  const moreEnded = await waitUntilTerminal(faults.pool, moreIds, 20_000);
  const moreRequests = await requestsWithAttempts(faults.pool, moreIds);
  t.ok(
    moreEnded.done && moreRequests.every((request) => request.status === 'completed' && request.attempt_rows.every((attempt) => attempt.worker_id === frozenId)),
    `the resumed worker, alone, completed 5 new requests (${JSON.stringify(moreEnded.byStatus)})`,
  );
  t.equal((await dispatchJobs(faults.db)).length, 0, 'no dispatch_queue job is left behind, locked or not');

  await faults.finish(t);
});

t.test('a worker frozen past WORKER_DEAD_AFTER_MS with webhook tries under way, then resumed: the tries are made again elsewhere, and their late answers change nothing', async (t) => {
  // The first try of each message is answered 204 once the frozen worker is resumed; any later one at once.
  let releaseFirstTries = () => {};
  const resumed = new Promise<void>((resolve) => (releaseFirstTries = resolve));
  const tried = new Set<string>();
  const receiver = await startReceiver(t, async (delivery) => {
    const id = String(delivery.headers['webhook-id']);
    if (!tried.has(id)) {
      tried.add(id);
      await resumed;
    }
    return { status: 204 };
  });
  const faults = await faultContext(t, `${SCENARIO}-webhooks`);
  const env = { WORKER_DEAD_AFTER_MS: String(DEAD_AFTER_MS), SHUTDOWN_GRACE_MS: '1000', WEBHOOK_ALLOW_PRIVATE: 'true' };
  const api = await faults.start('api', { env });
  const project = 'worker-frozen-webhooks';
  const key = await faults.createKey({ project, mode: 'test' });
  receiver.secrets.push((await faults.addEndpoint({ project, url: receiver.url })).secret);

  // The first worker runs every request, and starts the try of each one's event; the second
  // starts once the tries are all under way.
  const frozen = await faults.start('worker', { label: 'worker-frozen', env: { ...env, LOG_LEVEL: 'debug' } });
  const accepted = await Promise.all(
    Array.from({ length: TRIES }, (_, i) =>
      call(api.url!, { path: '/v1/chat/completions', key, body: { model: 'test-echo', messages: [{ role: 'user', content: privateContent(`frozen webhook ${i}`) }] } }),
    ),
  );
  t.equal(tally(accepted.map((answer) => answer.status)), `202: ${TRIES}`, `all ${TRIES} acknowledged`);
  t.ok(await waitFor(() => receiver.open >= TRIES, 30_000), `the first worker has the ${TRIES} tries under way (${receiver.open})`);
  await faults.start('worker', { label: 'worker-other', env });

  frozen.signal('SIGSTOP');
  t.teardown(() => frozen.signal('SIGCONT'));
  const delivered = async () => (await messagesOf(faults.db)).filter((message) => message.status === 'delivered').length;
  t.ok(await waitFor(async () => (await delivered()) >= TRIES, 30_000), `while the first worker is frozen, the other delivers every message again (${await delivered()})`);

  frozen.signal('SIGCONT');
  releaseFirstTries();
  await waitFor(() => staleLines(frozen.lines, DELIVERED) >= TRIES, 15_000);
  t.equal(staleLines(frozen.lines, DELIVERED), TRIES, 'the resumed worker went to record each late 2xx, and found its try handed back');

  const messages = await messagesOf(faults.db);
  t.same(messages.map((message) => message.status), Array(TRIES).fill('delivered'), 'every message delivered');
  const tries = await Promise.all(messages.map(async (message) => (await triesOf(faults.db, message.id)).map((row) => `${row.try_number} ${row.outcome}`).join(', ')));
  t.same(tries, Array(TRIES).fill('1 failed, 2 succeeded'), "each: its first try recorded failed (handed back), its second succeeded; the late answer recorded nowhere");
  const byMessage = new Map<string, number>();
  for (const delivery of receiver.deliveries) byMessage.set(String(delivery.headers['webhook-id']), (byMessage.get(String(delivery.headers['webhook-id'])) ?? 0) + 1);
  t.same(
    messages.map((message) => byMessage.get(message.id)),
    Array(TRIES).fill(2),
    'the receiver got each message twice, with its webhook-id both times (as Standard Webhooks lets it tell)',
  );
  t.ok(receiver.deliveries.every((delivery) => delivery.verifiedWith.length === 1), 'every delivery verified');

  await faults.finish(t);
});
