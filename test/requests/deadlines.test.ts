// Request deadlines (docs/lanes.md, "Deadlines"): every request has one, its key's or
// REQUEST_DEADLINE, counted from its acceptance. A request not finished by then fails with
// deadline_exceeded within a few seconds, wherever it is: running (its call aborted), or waiting
// in a lane that cannot run it; its waiters are answered and its webhook event sent.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { attemptRows, isTerminal, requestRow, waitForRow } from '../helpers/rows.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';
import { addTestEndpoint, messagesOf, startReceiver } from '../webhooks/support.ts';

t.test('a request\'s deadline is its acceptance plus its key\'s deadline, or REQUEST_DEADLINE', async (t) => {
  const api = await startTestGateway(t, { role: 'api', env: { REQUEST_DEADLINE: '2h' } });
  const ownDeadline = await api.createKey({ deadlineMs: 15 * 60_000 });
  const serverDeadline = await api.createKey();
  const deadlineAfterAcceptance = async (key: typeof ownDeadline) => {
    const accepted = await clientFor(api.url, key).post({ model: 'test-echo', messages: userMessage() });
    t.equal(accepted.status, 202);
    const { rows } = await api.pool.query<{ ms: number }>(
      `select (extract(epoch from deadline_at - created_at) * 1000)::float8 as ms from gateway.requests where id = $1`,
      [accepted.body.id],
    );
    return rows[0]?.ms;
  };
  t.equal(await deadlineAfterAcceptance(ownDeadline), 15 * 60_000, 'the key\'s own: 15 minutes');
  t.equal(await deadlineAfterAcceptance(serverDeadline), 2 * 3_600_000, 'REQUEST_DEADLINE: 2 hours');
});

/**
 * Settings under which only the deadline can end a call within a test's wait of 10 s: the
 * upstream timeout and the wait are longer. A request failed with deadline_exceeded is failed by
 * the expiry (the one statement that writes that code), which every worker runs about once a
 * second: failed within that wait is the expiry on time, whatever the machine's speed.
 */
const LONGER_THAN_DEADLINES = { UPSTREAM_TIMEOUT_MS: '30000', WAIT_TIMEOUT_MS: '15000' };

/** How long after its deadline the request ended, by the database's clock. */
async function lateness(gateway: TestGateway, id: string): Promise<number> {
  const { rows } = await gateway.pool.query<{ ms: number }>(
    `select (extract(epoch from finished_at - deadline_at) * 1000)::float8 as ms from gateway.requests where id = $1`,
    [id],
  );
  return rows[0]!.ms;
}

t.test('a running call whose deadline passes: aborted, its request failed with deadline_exceeded within seconds, its event sent', async (t) => {
  const upstream = await startFakeUpstream(t, () => ({ hang: true }));
  const gateway = await startTestGateway(t, {
    env: { ...LONGER_THAN_DEADLINES, UPSTREAM_BASE_URL: upstream.baseUrl, WEBHOOK_ALLOW_PRIVATE: 'true' },
  });
  const key = await gateway.createKey({ mode: 'live', deadlineMs: 2_000 });
  const receiver = await startReceiver(t);
  receiver.secrets = [(await addTestEndpoint(gateway, { url: receiver.url })).secret];

  const accepted = await clientFor(gateway.url, key).post({ model: 'gpt-x', messages: userMessage() });
  t.equal(accepted.status, 202);
  const id = accepted.body.id as string;
  await until(() => upstream.calls.length === 1, 'the call to reach the upstream');
  t.match(await requestRow(gateway.db, id), { status: 'processing', attempts: 1 });

  const row = await waitForRow(gateway.db, id, isTerminal, 10_000);
  t.match(row, { status: 'failed', last_error_code: 'deadline_exceeded', attempts: 1, result: null });
  const late = await lateness(gateway, id);
  t.ok(late >= 0, `not before its deadline: failed ${late} ms after it`);
  t.match(await attemptRows(gateway.db, id), [
    { attempt_number: 1, outcome: 'failed', error_code: 'deadline_exceeded', error_detail: 'the request\'s deadline passed during the call' },
  ]);

  // The upstream holds the connection until the worker's 30 s timeout: closed within the wait is the call aborted.
  const call = upstream.calls[0]!;
  await until(() => call.endedAt !== undefined, 'the upstream connection to close', 3_000);

  const lookup = await clientFor(gateway.url, key).get(id);
  t.match(lookup.body, { id, status: 'failed', attempts: 1, last_error_code: 'deadline_exceeded' });
  await until(() => receiver.deliveries.length > 0, 'the webhook delivery');
  t.match(await messagesOf(gateway.db, id), [{ event_type: 'request.failed' }], 'one event, request.failed');
  t.match(receiver.deliveries[0]!.event, { type: 'request.failed', data: { id, status: 'failed', last_error_code: 'deadline_exceeded' } });
  t.same(receiver.deliveries[0]!.verifiedWith, [0], 'signed as every delivery is');

  await sleep(500);
  t.equal(upstream.calls.length, 1, 'never called again');
  t.equal((await attemptRows(gateway.db, id)).length, 1, 'and nothing more recorded');
  t.ok(gateway.logs.some((line) => line.includes('"expired":1') && line.includes('their deadline passed')), 'the expiry logged');
});

t.test('a request waiting for a paused lane fails on time too, never having been attempted', async (t) => {
  const upstream = await startFakeUpstream(t);
  const gateway = await startTestGateway(t, { env: { ...LONGER_THAN_DEADLINES, UPSTREAM_BASE_URL: upstream.baseUrl } });
  // Its lane paused for a day, as a 429 with a long retry-after would leave it.
  await gateway.pool.query(
    `with queue as (insert into gateway.queues (mode, model) values ('live', 'gpt-x') returning id)
     insert into gateway.lanes (mode, upstream, model, queue_id, paused_until)
     select 'live', 'default', 'gpt-x', id, now() + interval '1 day' from queue`,
  );
  const key = await gateway.createKey({ mode: 'live', deadlineMs: 1_000 });
  const accepted = await clientFor(gateway.url, key).post({ model: 'gpt-x', messages: userMessage() });
  t.equal(accepted.status, 202);
  const id = accepted.body.id as string;
  t.match(await requestRow(gateway.db, id), { status: 'queued' });

  const row = await waitForRow(gateway.db, id, isTerminal, 10_000);
  t.match(row, { status: 'failed', last_error_code: 'deadline_exceeded', attempts: 0, next_attempt_at: null });
  const late = await lateness(gateway, id);
  t.ok(late >= 0, `not before its deadline: failed ${late} ms after it`);
  t.ok(gateway.logs.some((line) => line.includes('"expired":1') && line.includes('their deadline passed')), 'by the expiry');
  t.same(await attemptRows(gateway.db, id), [], 'no attempt');
  t.equal(upstream.calls.length, 0, 'the upstream never called');
});

t.test('a wait=true request whose deadline passes is answered with its acknowledgement, status failed', async (t) => {
  // The simulator would take 10 s; the deadline comes first, and the wait (the longest there is,
  // ten minutes, past the test's own time) much later still: an answer at all is the one given
  // once the request failed, not the one at the wait's end (which would say failed too). The test
  // waits 20 s for it, not the ten minutes, so that a waiter left to its wait's end fails here
  // rather than holding the file until tap's timeout.
  const gateway = await startTestGateway(t, { env: { ...LONGER_THAN_DEADLINES, WAIT_TIMEOUT_MS: '600000' } });
  const key = await gateway.createKey({ deadlineMs: 1_000 });
  const answering = clientFor(gateway.url, key).post({ model: 'test-delay-10000', messages: userMessage(), wait: true });
  const answer = await Promise.race([answering, sleep(20_000).then(() => undefined)]);
  t.equal(answer?.status, 202, 'answered once the request failed, not at the wait\'s end');
  if (answer === undefined) return;
  t.match(answer.body, { object: 'chat.completion.async', status: 'failed' });
  t.match(await requestRow(gateway.db, answer.body.id), { status: 'failed', last_error_code: 'deadline_exceeded' });
  t.match(await attemptRows(gateway.db, answer.body.id), [{ outcome: 'failed', error_code: 'deadline_exceeded' }]);
});
