// POST /v1/requests/{id}/cancel (docs/api.md, "Cancelling a request"), in each state: a queued
// or retrying request is cancelled at once and never attempted again; a processing one has its
// upstream call aborted by the worker process that holds it, and its attempt recorded as
// cancelled; a waiting wait=true client is answered at once; a finished request is a 409,
// another's a 404.
import t from 'tap';
import { createTestDatabase } from '../helpers/database.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { plantRequest } from '../helpers/populate.ts';
import { apiWaitingOnLock, attemptRows, isTerminal, requestRow, waitForRow } from '../helpers/rows.ts';
import { spawnServe } from '../helpers/serve.ts';
import { newNonce, signature } from '../helpers/signing.ts';
import { startTcpProxy } from '../helpers/tcp-proxy.ts';
import { completionFor, startFakeUpstream } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';
import { addTestEndpoint, startReceiver } from '../webhooks/support.ts';

const RECORD_FIELDS = ['attempts', 'created_at', 'id', 'last_error_code', 'status', 'updated_at'];
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

function cancelOf(baseUrl: string, key: Parameters<typeof clientFor>[1]) {
  return (id: string, body?: string) =>
    send(baseUrl, { method: 'POST', path: `/v1/requests/${id}/cancel`, key, ...(body === undefined ? {} : { body }) });
}

t.test('a queued request: cancelled at once, answered with its record, and never attempted', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const key = await api.createKey();
  const accepted = await clientFor(api.url, key).post({ model: 'test-echo', messages: userMessage() });
  const cancel = cancelOf(api.url, key);

  const answer = await cancel(accepted.body.id);
  t.equal(answer.status, 200);
  t.same(Object.keys(answer.body).sort(), RECORD_FIELDS, 'the record, without result');
  t.match(answer.body, { id: accepted.body.id, status: 'cancelled', attempts: 0, last_error_code: null });
  t.match(await requestRow(api.db, accepted.body.id), { status: 'cancelled', attempts: 0 });
  t.ok((await requestRow(api.db, accepted.body.id))?.finished_at, 'finished');

  const again = await cancel(accepted.body.id);
  t.equal(again.status, 200, 'cancelling it again answers its record again');
  t.same(again.body, answer.body);

  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl });
  await sleep(500);
  t.same(await attemptRows(api.db, accepted.body.id), [], 'a worker never starts it');
  t.match(await requestRow(api.db, accepted.body.id), { status: 'cancelled' });
  const lookup = await clientFor(api.url, key).get(accepted.body.id);
  t.match(lookup.body, { status: 'cancelled' }, 'lookups show it cancelled');
});

t.test('a retrying request: cancelled, its last_error_code kept, not attempted again', async (t) => {
  const upstream = await startFakeUpstream(t, () => ({ status: 500, json: { error: { message: 'down' } } }));
  const gateway = await startTestGateway(t, {
    env: { UPSTREAM_BASE_URL: upstream.baseUrl, RETRY_BASE_MS: '60000', RETRY_MAX_MS: '60000' },
  });
  const key = await gateway.createKey({ mode: 'live' });
  const accepted = await clientFor(gateway.url, key).post({ model: 'gpt-x', messages: userMessage() });
  await waitForRow(gateway.db, accepted.body.id, (row) => row.status === 'retrying');

  const answer = await cancelOf(gateway.url, key)(accepted.body.id);
  t.equal(answer.status, 200);
  t.match(answer.body, { status: 'cancelled', attempts: 1, last_error_code: 'upstream_server_error' });
  // Were its retry's dispatch to come due now, nothing would start it.
  await gateway.pool.query(`update graphile_worker._private_jobs set run_at = now()`);
  await sleep(500);
  t.equal(upstream.calls.length, 1, 'the upstream was called once, for the attempt before the cancel');
  t.match(await attemptRows(gateway.db, accepted.body.id), [{ attempt_number: 1, outcome: 'failed' }]);
});

t.test('a processing request in another worker process: its call aborted, not left to its timeout, its attempt recorded as cancelled', async (t) => {
  const upstream = await startFakeUpstream(t, () => ({ hang: true }));
  // The longest wait timeout there is, ten minutes, and a minute of upstream timeout: the waiting
  // client answered, and the upstream's connection closed, within the test are the cancel's doing.
  const api = await startTestGateway(t, { role: 'api', env: { UPSTREAM_BASE_URL: upstream.baseUrl, WAIT_TIMEOUT_MS: '600000' } });
  const worker = spawnServe(
    t,
    {
      DATABASE_URL: api.databaseUrl,
      UPSTREAM_BASE_URL: upstream.baseUrl,
      UPSTREAM_TIMEOUT_MS: '60000',
      PORT: '0',
      HOST: '127.0.0.1',
      LOG_LEVEL: 'info',
      WORKER_POLL_INTERVAL_MS: '50',
    },
    ['--role', 'worker'],
  );
  await until(() => worker.output().includes('worker pool started'), () => `the worker:\n${worker.output()}`, 15_000);
  const key = await api.createKey({ mode: 'live' });
  // A client waiting for it (wait=true) too.
  const waiting = clientFor(api.url, key).post({ model: 'gpt-x', messages: userMessage(), wait: true });
  await until(() => upstream.calls.length === 1, 'the call to reach the upstream', 10_000);
  const call = upstream.calls[0]!;
  const id = (await api.pool.query(`select id from gateway.requests`)).rows[0].id as string;
  t.match(await requestRow(api.db, id), { status: 'processing', attempts: 1 });

  const cancelledAt = Date.now();
  const answer = await cancelOf(api.url, key)(id);
  t.equal(answer.status, 200);
  t.match(answer.body, { status: 'cancelled', attempts: 1 });

  // 20 s, not the ten minutes: a waiter left to its wait timeout fails here, rather than holding
  // the file until tap's timeout.
  const acknowledged = await Promise.race([waiting, sleep(20_000).then(() => undefined)]);
  t.equal(acknowledged?.status, 202, 'the waiting client is answered, not left to its wait timeout');
  t.match(acknowledged?.body, { id, object: 'chat.completion.async', status: 'cancelled' }, 'its acknowledgement, status cancelled');

  await until(() => call.endedAt !== undefined, 'the upstream connection to close, long before its 60 s timeout', 15_000);
  t.comment(`the upstream saw its connection closed ${call.endedAt! - cancelledAt} ms after the cancel`);
  t.match(await attemptRows(api.db, id), [{ attempt_number: 1, outcome: 'cancelled', error_code: null }], 'the attempt recorded as cancelled');
  await sleep(300);
  t.match(await requestRow(api.db, id), { status: 'cancelled', result: null }, 'and it stays cancelled');
  t.equal(upstream.calls.length, 1, 'no retry');
});

t.test('a processing request whose worker\'s LISTEN connection went silent: its call aborted all the same, within 15 s, not after its timeout', async (t) => {
  const upstream = await startFakeUpstream(t, () => ({ hang: true }));
  const databaseUrl = await createTestDatabase(t);
  // The worker reaches Postgres through a proxy that can silence its LISTEN connection (as a NAT
  // that forgets the flow does); the cancel comes through an API process connected directly.
  const proxy = await startTcpProxy(t, databaseUrl);
  const env = { UPSTREAM_BASE_URL: upstream.baseUrl, UPSTREAM_TIMEOUT_MS: '60000' };
  const api = await startTestGateway(t, { role: 'api', databaseUrl, env });
  const worker = await startTestGateway(t, { role: 'worker', databaseUrl: proxy.url, env });
  const key = await api.createKey({ mode: 'live' });
  const accepted = await clientFor(api.url, key).post({ model: 'gpt-x', messages: userMessage() });
  await until(() => upstream.calls.length === 1, 'the call to reach the upstream', 10_000);

  t.equal(proxy.blackHole('gateway-listen'), 1, 'the worker\'s LISTEN connection goes silent');
  const cancelledAt = Date.now();
  t.equal((await cancelOf(api.url, key)(accepted.body.id)).status, 200);
  await until(() => upstream.calls[0]!.endedAt !== undefined, 'the call to be aborted', 15_000);
  t.comment(`the upstream saw its connection closed ${upstream.calls[0]!.endedAt! - cancelledAt} ms after the cancel`);
  await until(async () => (await attemptRows(api.db, accepted.body.id))[0]?.outcome === 'cancelled', 'the attempt recorded as cancelled');
  t.ok(worker.logs.some((line) => line.includes('LISTEN connection found dead')), 'the worker found its connection dead');
});

t.test('completed and failed requests are a 409; another project\'s, another mode\'s and unknown ids a 404', async (t) => {
  const gateway = await startTestGateway(t);
  const key = await gateway.createKey({ project: 'mine' });
  const client = clientFor(gateway.url, key);
  const cancel = cancelOf(gateway.url, key);
  const completed = (await client.post({ model: 'test-echo', messages: userMessage() })).body.id;
  const failed = (await client.post({ model: 'test-error-400', messages: userMessage() })).body.id;
  for (const id of [completed, failed]) await waitForRow(gateway.db, id, isTerminal);
  for (const id of [completed, failed]) {
    const answer = await cancel(id);
    t.equal(answer.status, 409);
    t.match(answer.body.error, { type: 'invalid_request_error', code: 'request_already_finished', param: null });
  }
  t.match(await requestRow(gateway.db, completed), { status: 'completed' }, 'unchanged');

  const queued = (await client.post({ model: 'test-delay-1500', messages: userMessage() })).body.id;
  for (const other of [await gateway.createKey({ project: 'theirs' }), await gateway.createKey({ project: 'mine', mode: 'live' })]) {
    const answer = await cancelOf(gateway.url, other)(queued);
    t.equal(answer.status, 404);
    t.match(answer.body.error, { type: 'not_found_error', code: 'request_not_found' });
  }
  for (const id of ['req_00000000000000000000', 'not-an-id']) t.equal((await cancel(id)).status, 404);
  t.not((await requestRow(gateway.db, queued))?.status, 'cancelled', 'their cancels changed nothing');
});

t.test('a cancel is signed, takes no body, and its nonce is accepted once', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const key = await api.createKey();
  const id = (await clientFor(api.url, key).post({ model: 'test-echo', messages: userMessage() })).body.id;
  const withBody = await cancelOf(api.url, key)(id, '{}');
  t.equal(withBody.status, 400);
  t.match(withBody.body.error, { code: 'invalid_body' });
  const unsigned = await send(api.url, { method: 'POST', path: `/v1/requests/${id}/cancel`, key: key.api_key });
  t.equal(unsigned.status, 401);
  t.match(unsigned.body.error, { code: 'missing_signature' });
  t.match(await requestRow(api.db, id), { status: 'queued' }, 'neither cancelled it');

  // A POST: its nonce is accepted once.
  const header = signature({ secret: key.signing_secret, method: 'POST', path: `/v1/requests/${id}/cancel` });
  const signed = () => send(api.url, { method: 'POST', path: `/v1/requests/${id}/cancel`, key: key.api_key, headers: { 'svc-signature': header } });
  t.equal((await signed()).status, 200);
  const replayed = await signed();
  t.equal(replayed.status, 401, 'the same signed cancel again is a replay');
  t.match(replayed.body.error, { code: 'replayed_request' });
});

t.test('a refused cancel (404, 409) leaves no nonce behind; a successful one consumes it, once however many race', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const key = await api.createKey();
  /** The same signed cancel each time it is called: one nonce. */
  const signedCancel = (id: string, nonce = newNonce()) => {
    const path = `/v1/requests/${id}/cancel`;
    const header = signature({ secret: key.signing_secret, method: 'POST', path, nonce });
    return { nonce, send: () => send(api.url, { method: 'POST', path, key: key.api_key, headers: { 'svc-signature': header } }) };
  };
  const stored = async (nonce: string) =>
    Number((await api.pool.query('select count(*) from gateway.signature_nonces where nonce = $1', [nonce])).rows[0].count);

  const completed = await plantRequest(api, key, { status: 'completed' });
  const refusals: [string, number][] = [['req_00000000000000000000', 404], ['not-an-id', 404], [completed.id, 409]];
  for (const [id, status] of refusals) {
    const cancel = signedCancel(id);
    t.equal((await cancel.send()).status, status, `${id}: ${status}`);
    t.equal(await stored(cancel.nonce), 0, `${id}: its nonce is not stored`);
    t.equal((await cancel.send()).status, status, `${id}: the same signed cancel again is answered alike, not as a replay`);
  }

  const queued = await plantRequest(api, key, { status: 'queued' });
  const cancel = signedCancel(queued.id);
  t.equal((await cancel.send()).status, 200);
  t.equal(await stored(cancel.nonce), 1, 'a successful cancel stores its nonce');
  t.match((await cancel.send()).body.error, { code: 'replayed_request' }, 'and its replay is refused');

  // The same signed cancel sent several times at once: one cancels, the others are replays.
  for (let round = 0; round < 5; round++) {
    const racing = signedCancel((await plantRequest(api, key, { status: 'queued' })).id);
    const answers = await Promise.all([racing.send(), racing.send(), racing.send()]);
    t.same(answers.map((answer) => answer.status).sort(), [200, 401, 401], `round ${round}: exactly one succeeds`);
  }
});

t.test('a cancel that waits for the claim starting its request records the attempt that claim committed as cancelled, ended after it started', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const key = await api.createKey();
  const { id } = await plantRequest(api, key, { status: 'queued' });

  // A claim starting the request, not committed yet: it holds the request's row. Its attempt's
  // row is written once the cancel waits for that row, and committed after the cancel's statement
  // began, with the time it is written as its start: a claim whose transaction began after the
  // cancel's statement, and locked the row before it.
  const claim = await api.pool.connect();
  t.teardown(() => claim.release());
  await claim.query('begin');
  await claim.query(`update gateway.requests set status = 'processing', attempts = 1, next_attempt_at = null where id = $1`, [id]);
  const cancelling = cancelOf(api.url, key)(id);
  await until(async () => (await apiWaitingOnLock(api.pool)) === 1, 'the cancel to wait for the request\'s row');
  await claim.query(`insert into gateway.request_attempts (request_id, attempt_number, worker_id, started_at) values ($1, 1, 'a-worker', clock_timestamp())`, [id]);
  await claim.query('commit');

  const answer = await cancelling;
  t.equal(answer.status, 200);
  t.match(answer.body, { id, status: 'cancelled', attempts: 1 });
  const request = await requestRow(api.db, id);
  t.match(request, { status: 'cancelled' });
  const attempts = await attemptRows(api.db, id);
  t.same(
    attempts.map((attempt) => ({ attempt: attempt.attempt_number, outcome: attempt.outcome, finished: attempt.finished_at !== null })),
    [{ attempt: 1, outcome: 'cancelled', finished: true }],
    'its attempt is recorded as cancelled, not left running for its worker to record as succeeded',
  );
  const [attempt] = attempts;
  t.ok(
    attempt!.finished_at! >= attempt!.started_at && request!.finished_at! >= attempt!.started_at && attempt!.duration_ms! >= 0,
    `the attempt and its request ended after it started (started ${attempt!.started_at.toISOString()}, ` +
      `ended ${attempt!.finished_at!.toISOString()} after ${attempt!.duration_ms} ms; the request ended ${request!.finished_at!.toISOString()})`,
  );
});

t.test('a cancel racing the upstream\'s answer: each request ends cancelled or completed, never both, and its webhook says which', async (t) => {
  const upstream = await startFakeUpstream(t, async (call) => {
    await sleep(100);
    return { status: 200, json: completionFor(call.body) };
  });
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl, WEBHOOK_ALLOW_PRIVATE: 'true' } });
  const key = await gateway.createKey({ mode: 'live' });
  const receiver = await startReceiver(t);
  receiver.secrets.push((await addTestEndpoint(gateway, { url: receiver.url })).secret);
  const client = clientFor(gateway.url, key);
  const cancel = cancelOf(gateway.url, key);
  const ids: string[] = [];
  await Promise.all(
    Array.from({ length: 40 }, async (_, i) => {
      const id = (await client.post({ model: 'gpt-x', messages: userMessage(`race ${i}`) })).body.id as string;
      ids.push(id);
      // Around the moment the answer comes back.
      await sleep(80 + (i % 8) * 10);
      const answer = await cancel(id);
      t.ok(answer.status === 200 || answer.status === 409, `cancel answered ${answer.status}`);
    }),
  );
  const ended = { cancelled: 0, completed: 0 };
  for (const id of ids) {
    const row = await waitForRow(gateway.db, id, isTerminal);
    const attempts = await attemptRows(gateway.db, id);
    if (row.status === 'cancelled') {
      ended.cancelled++;
      t.equal(row.result, null);
      t.ok(attempts.every((attempt) => attempt.outcome !== 'succeeded'), 'no attempt of a cancelled request succeeded');
    } else {
      ended.completed++;
      t.equal(row.status, 'completed');
      t.ok(row.result);
      t.match(attempts.at(-1), { outcome: 'succeeded' });
    }
  }
  t.comment(`cancelled ${ended.cancelled}, completed ${ended.completed}`);
  t.equal(ended.cancelled + ended.completed, ids.length);

  await until(() => new Set(receiver.deliveries.map((delivery) => delivery.headers['webhook-id'])).size === ids.length, 'an event for each', 10_000);
  for (const id of ids) {
    const row = await requestRow(gateway.db, id);
    const events = receiver.deliveries.filter((delivery) => delivery.event?.data.id === id);
    t.ok(events.length >= 1 && events.every((delivery) => delivery.verifiedWith.length === 1), `${id}: verified events`);
    t.same(new Set(events.map((delivery) => delivery.event!.type)), new Set([`request.${row!.status}`]), `${id}: its webhook says ${row!.status}`);
  }
});
