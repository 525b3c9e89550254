// The deliverer on its own (no graphile-worker: the test runs the deliver_webhook jobs that are
// due), against a real database and a loopback receiver that verifies every delivery with the
// official standardwebhooks package: what is sent and how it is signed, retries on the
// schedule, 410, the SSRF guard, secret rotation, capacity, a missing encryption key, the
// sweep's recovery of lost tries, and shutdown.
import { randomBytes } from 'node:crypto';
import { sql } from 'kysely';
import t from 'tap';
import { claimMessage, finishTry } from '../../src/webhooks/delivery-repository.ts';
import { ENDPOINT_BACKOFF, eventBody, MAX_RETRY_WAIT_MS, nextTryDelay, wakeDelay } from '../../src/webhooks/deliverer.ts';
import { removeEndpoint, rotateSecret } from '../../src/webhooks/endpoints.ts';
import { oldestUnfinishedMessageAge } from '../../src/webhooks/repository.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor } from '../helpers/http.ts';
import { freePort } from '../helpers/ports.ts';
import { until } from '../helpers/wait.ts';
import {
  addTestEndpoint,
  deliveryJobs,
  endRequest,
  messagesOf,
  metricValue,
  startReceiver,
  testDeliverer,
  triesOf,
  wakeJobs,
} from './support.ts';

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

t.test('the wait before each retry: the schedule with ±10 % jitter, a longer retry-after, at most 24 h, none once spent', async (t) => {
  const schedule = [5_000, 300_000];
  t.equal(nextTryDelay(schedule, 1, undefined, () => 0), 4_500);
  t.equal(nextTryDelay(schedule, 1, undefined, () => 1), 5_500);
  t.equal(nextTryDelay(schedule, 2, undefined, () => 0.5), 300_000);
  t.equal(nextTryDelay(schedule, 1, 60_000, () => 0.5), 60_000, 'a retry-after longer than the wait is honoured');
  t.equal(nextTryDelay(schedule, 1, 1_000, () => 0.5), 5_000, 'a shorter one changes nothing');
  t.equal(nextTryDelay(schedule, 1, 3 * MAX_RETRY_WAIT_MS, () => 0.5), MAX_RETRY_WAIT_MS, 'capped at 24 h');
  t.equal(nextTryDelay(schedule, 3), undefined, 'the schedule is spent after its last entry');
  for (let i = 0; i < 1_000; i++) {
    const delay = nextTryDelay(schedule, 1)!;
    if (delay < 4_500 || delay > 5_500) t.fail(`delay ${delay} outside ±10 %`);
  }
});

t.test('a delivery carries the event and the lookup record, signed as Standard Webhooks says; it is recorded delivered', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t);
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  receiver.secrets = [endpoint.secret];
  const { deliverer, metrics, runDueJobs } = testDeliverer(t, gateway);

  const ids = {
    completed: await endRequest(gateway, key, 'completed'),
    failed: await endRequest(gateway, key, 'failed'),
    cancelled: await endRequest(gateway, key, 'cancelled'),
  };
  const messages = await messagesOf(gateway.db);
  t.equal(messages.length, 3, 'one message per request that ended');
  t.same(messages.map((message) => message.status), ['pending', 'pending', 'pending']);
  t.equal((await deliveryJobs(gateway.db)).length, 3, 'each with its deliver_webhook job, written by the same transaction');

  t.same((await runDueJobs()).sort(), ['started', 'started', 'started'], 'each job starts a try and ends');
  await until(async () => (await messagesOf(gateway.db)).every((message) => message.status === 'delivered'), 'all delivered');
  t.equal(receiver.deliveries.length, 3, 'each event sent once');

  const lookup = clientFor(gateway.url, key);
  for (const [status, id] of Object.entries(ids)) {
    const message = (await messagesOf(gateway.db, id))[0]!;
    const delivery = receiver.deliveries.find((candidate) => candidate.headers['webhook-id'] === message.id);
    t.ok(delivery, `the ${status} request's event arrived, webhook-id = the message id`);
    if (!delivery) continue;
    t.same(delivery.verifiedWith, [0], 'standardwebhooks verifies it with the endpoint\'s secret');
    t.equal(delivery.headers['content-type'], 'application/json');
    t.match(delivery.headers['webhook-signature'], /^v1,[A-Za-z0-9+/]+={0,2}$/, 'one signature: one active secret');
    t.ok(Math.abs(Number(delivery.headers['webhook-timestamp']) - Date.now() / 1000) < 10, 'webhook-timestamp is now, in Unix seconds');
    t.equal(delivery.path, '/hooks');
    const record = await lookup.get(id);
    t.equal(record.status, 200);
    t.equal(
      delivery.body,
      `{"type":"request.${status}","timestamp":"${message.created_at.toISOString()}","data":${record.text}}`,
      'the body: type, the time the request ended, and the record exactly as GET /v1/requests/{id} answers it',
    );
    t.same(delivery.event, { type: `request.${status}`, timestamp: message.created_at.toISOString(), data: record.body });
    t.equal('result' in (delivery.event?.data ?? {}), status === 'completed', 'result only when completed');

    const [row] = await messagesOf(gateway.db, id);
    t.match(row, { status: 'delivered', tries: 1, worker_id: null, next_try_at: null });
    t.ok(row?.finished_at, 'finished');
    const tries = await triesOf(gateway.db, message.id);
    t.match(tries, [{ try_number: 1, outcome: 'succeeded', http_status: 204, error: null }]);
    t.ok(tries[0]!.duration_ms !== null && tries[0]!.finished_at !== null);
  }
  t.equal(await metricValue(metrics, 'gateway_webhook_deliveries_total{outcome="succeeded"}'), 3);
  t.equal(deliverer.inFlight, 0);
  t.same(await runDueJobs(), [], 'no job is left');
  t.equal(eventBody({ event_type: 'request.failed', created_at: new Date(0), request: { id: 'req_x', status: 'failed', attempts: 1, created_at: new Date(0), updated_at: new Date(0), last_error_code: 'upstream_bad_request', result: null } }),
    '{"type":"request.failed","timestamp":"1970-01-01T00:00:00.000Z","data":{"id":"req_x","status":"failed","attempts":1,"created_at":"1970-01-01T00:00:00.000Z","updated_at":"1970-01-01T00:00:00.000Z","last_error_code":"upstream_bad_request"}}');
});

t.test('an endpoint gets only the events it takes, and only its own project\'s', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey({ project: 'alpha' });
  const other = await gateway.createKey({ project: 'beta' });
  const receiver = await startReceiver(t);
  await addTestEndpoint(gateway, { project: 'alpha', url: receiver.url, events: ['request.failed'] });
  await endRequest(gateway, key, 'completed');
  const failed = await endRequest(gateway, key, 'failed');
  await endRequest(gateway, other, 'failed');
  const messages = await messagesOf(gateway.db);
  t.same(messages.map((message) => [message.request_id, message.event_type]), [[failed, 'request.failed']]);
});

t.test('a failing endpoint is retried on the schedule until it answers 2xx; retry-after is honoured', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const answers = [
    { status: 500 },
    { status: 503, headers: { 'retry-after': '1' } },
    { status: 500 },
    { status: 200 },
  ];
  const receiver = await startReceiver(t, (delivery) => answers[delivery.count - 1] ?? { status: 200 });
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  receiver.secrets = [endpoint.secret];
  const schedule = [100, 200, 400];
  const { metrics, runDueJobs } = testDeliverer(t, gateway, { webhooks: { retryScheduleMs: schedule } });
  await endRequest(gateway, key, 'completed');
  const [message] = await messagesOf(gateway.db);

  await runDueJobs();
  await until(async () => (await triesOf(gateway.db, message!.id))[0]?.outcome === 'failed', 'the first try failed');
  const [afterFirst] = await messagesOf(gateway.db);
  t.match(afterFirst, { status: 'pending', tries: 1, worker_id: null, finished_at: null });
  const jobs = await deliveryJobs(gateway.db);
  t.equal(jobs.length, 1, 'the retry\'s job was added with it');
  t.equal(jobs[0]!.run_at.getTime(), afterFirst!.next_try_at!.getTime(), 'due when the retry is');

  await until(
    async () => {
      await runDueJobs();
      return (await messagesOf(gateway.db))[0]!.status === 'delivered';
    },
    'delivered',
    10_000,
  );
  const tries = await triesOf(gateway.db, message!.id);
  t.same(
    tries.map((row) => [row.try_number, row.outcome, row.http_status, row.error]),
    [
      [1, 'failed', 500, 'HTTP 500'],
      [2, 'failed', 503, 'HTTP 503'],
      [3, 'failed', 500, 'HTTP 500'],
      [4, 'succeeded', 200, null],
    ],
    'four tries: a row each',
  );
  const gaps = tries.slice(1).map((row, index) => row.started_at.getTime() - tries[index]!.started_at.getTime());
  t.ok(gaps[0]! >= 0.9 * schedule[0]!, `the first retry waited ${gaps[0]} ms (schedule: ${schedule[0]} ms ±10 %)`);
  t.ok(gaps[1]! >= 1_000, `the second waited ${gaps[1]} ms: the endpoint's retry-after of 1 s, longer than the schedule's ${schedule[1]} ms`);
  t.ok(gaps[2]! >= 0.9 * schedule[2]!, `the third waited ${gaps[2]} ms (schedule: ${schedule[2]} ms ±10 %)`);
  t.same(new Set(receiver.deliveries.map((delivery) => delivery.headers['webhook-id'])), new Set([message!.id]), 'the same webhook-id on every try');
  t.ok(receiver.deliveries.every((delivery) => delivery.verifiedWith.length === 1), 'each try freshly signed and verified');
  t.equal(await metricValue(metrics, 'gateway_webhook_deliveries_total{outcome="failed"}'), 3);
  t.equal(await metricValue(metrics, 'gateway_webhook_deliveries_total{outcome="succeeded"}'), 1);
  t.same(await deliveryJobs(gateway.db), [], 'no job is left');
});

t.test('a 429 or 503 with retry-after holds back the endpoint\'s other events too, for every worker, spending none of their retries', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const retryAfterMs = 2_000;
  const { runDueJobs } = testDeliverer(t, gateway);
  for (const status of [429, 503]) {
    const key = await gateway.createKey({ project: `refusing-${status}` });
    // It refuses the first delivery, asking for 2 s; it would take any other.
    const receiver = await startReceiver(t, (delivery) =>
      delivery.count === 1 ? { status, headers: { 'retry-after': String(retryAfterMs / 1000) } } : { status: 204 },
    );
    const endpoint = await addTestEndpoint(gateway, { project: `refusing-${status}`, url: receiver.url });
    const refused = await endRequest(gateway, key, 'completed');
    // Another worker's try of the endpoint, under way when the refusal comes.
    const elsewhere = (await messagesOf(gateway.db, await endRequest(gateway, key, 'cancelled')))[0]!;
    const claim = await claimMessage(gateway.db, elsewhere.id, 'worker-other', 3_000);
    t.same(await runDueJobs(), ['started', 'nothing'], `${status}: the first event is tried`);
    await until(async () => (await messagesOf(gateway.db, refused))[0]!.status !== 'delivering', `${status}: the refused try ended`);
    t.match(await messagesOf(gateway.db, refused), [{ status: 'pending', failures: 1 }], `${status}: the refused event waits its retry`);
    const pausedUntil = async () =>
      (await gateway.pool.query('select backoff_ms, paused_until from gateway.webhook_endpoints where id = $1', [endpoint.id])).rows[0];
    const pause = await pausedUntil();
    t.equal(pause.backoff_ms, null, `${status}: not a backoff`);
    t.ok(pause.paused_until.getTime() >= receiver.deliveries[0]!.receivedAt + retryAfterMs - 50, `${status}: the endpoint is paused for its retry-after`);
    // That try's answer, a 2xx, does not end the pause.
    if (claim.kind !== 'claimed') throw new Error(`claimed: ${claim.kind}`);
    const end = { messageId: elsewhere.id, endpointId: endpoint.id, tryNumber: 1, kind: 'delivered', httpStatus: 204, error: null, durationMs: 1, timedOut: false } as const;
    t.equal(await finishTry(gateway.db, end, ENDPOINT_BACKOFF), 'delivered');
    t.same(await pausedUntil(), pause, `${status}: a 2xx meanwhile leaves the pause as it was`);

    // Two more events of the endpoint, due at once, meanwhile.
    const others = [await endRequest(gateway, key, 'completed'), await endRequest(gateway, key, 'failed')];
    t.same(await runDueJobs(), ['deferred', 'deferred'], `${status}: the endpoint's other events are not tried during its retry-after`);
    for (const other of others) {
      t.match(await messagesOf(gateway.db, other), [{ status: 'pending', tries: 0, failures: 0 }], `${status}: waiting, no try spent`);
    }
    t.equal(receiver.deliveries.length, 1, `${status}: the receiver got only the refused try`);
    const [wake] = (await wakeJobs(gateway.db)).filter((job) => job.endpoint_id === endpoint.id);
    t.ok(wake && wake.run_at.getTime() >= receiver.deliveries[0]!.receivedAt + retryAfterMs - 50, `${status}: their endpoint's wake is due once its retry-after is over`);

    await until(
      async () => {
        await runDueJobs();
        return (await messagesOf(gateway.db)).filter((message) => message.endpoint_id === endpoint.id).every((m) => m.status === 'delivered');
      },
      `${status}: all delivered`,
      10_000,
    );
    t.equal(receiver.deliveries.length, 4, `${status}: the refused event twice, the others once each`);
    for (const delivery of receiver.deliveries.slice(1)) {
      t.ok(
        delivery.receivedAt >= receiver.deliveries[0]!.receivedAt + retryAfterMs - 50,
        `${status}: delivery ${delivery.count} came ${delivery.receivedAt - receiver.deliveries[0]!.receivedAt} ms after the refusal (retry-after: ${retryAfterMs} ms)`,
      );
    }
    for (const other of others) t.match(await messagesOf(gateway.db, other), [{ tries: 1, failures: 0 }], `${status}: delivered at its first try`);
  }
});

t.test('once the schedule is spent, the message fails', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, () => ({ status: 502 }));
  await addTestEndpoint(gateway, { url: receiver.url });
  const { runDueJobs } = testDeliverer(t, gateway, { webhooks: { retryScheduleMs: [50, 50] } });
  await endRequest(gateway, key, 'failed');
  await until(
    async () => {
      await runDueJobs();
      return (await messagesOf(gateway.db))[0]!.status === 'failed';
    },
    'failed',
    10_000,
  );
  const [message] = await messagesOf(gateway.db);
  t.match(message, { status: 'failed', tries: 3, next_try_at: null, worker_id: null });
  t.ok(message!.finished_at);
  t.equal(receiver.deliveries.length, 3, 'the first try and one retry per entry of the schedule');
  t.same(await deliveryJobs(gateway.db), [], 'no job is left');
});

t.test('gateway.failing_webhook_endpoints: not an endpoint holding its first try, but one with messages left after a failed try', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, () => ({ hang: true }));
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  const { runDueJobs } = testDeliverer(t, gateway, { webhooks: { retryScheduleMs: [60_000] } });
  const failing = async () => (await gateway.pool.query('select * from gateway.failing_webhook_endpoints')).rows;

  await endRequest(gateway, key, 'completed');
  t.same(await runDueJobs(), ['started']);
  await until(() => receiver.deliveries.length === 1, 'the receiver holds the first try');
  t.match(await messagesOf(gateway.db), [{ status: 'delivering', tries: 1 }], 'the try in flight counted');
  t.same(await failing(), [], 'an endpoint whose first try is in flight is not failing');

  receiver.release({ status: 500 });
  await until(async () => (await messagesOf(gateway.db))[0]!.status === 'pending', 'the try failed, a retry is due');
  t.match(await failing(), [{ id: endpoint.id, disabled_at: null, pending_messages: '1', last_failure_status: 500, last_failure_error: 'HTTP 500' }], 'after a failed try, with a message left, it is');
});

t.test('no answer in time, a dropped connection, a refused one: failed tries, in our words', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const hanging = await startReceiver(t, () => ({ hang: true }));
  const dropping = await startReceiver(t, () => ({ reset: true }));
  const closedPort = await freePort();
  const urls = [hanging.url, dropping.url, `http://127.0.0.1:${closedPort}/hooks`];
  for (const [index, url] of urls.entries()) await addTestEndpoint(gateway, { project: `p${index}`, url });
  const keys = [key, await gateway.createKey({ project: 'p0' }), await gateway.createKey({ project: 'p1' }), await gateway.createKey({ project: 'p2' })];
  const { runDueJobs } = testDeliverer(t, gateway, { webhooks: { timeoutMs: 300, retryScheduleMs: [] } });
  for (const owner of keys.slice(1)) await endRequest(gateway, owner, 'completed');
  await runDueJobs();
  await until(async () => (await messagesOf(gateway.db)).every((message) => message.status === 'failed'), 'all three failed', 5_000);
  const errors = [];
  for (const message of await messagesOf(gateway.db)) errors.push((await triesOf(gateway.db, message.id))[0]?.error);
  t.same(errors.sort(), ['connection refused', 'no answer within 0.3 s', 'the connection was closed before an answer']);
  hanging.release({ status: 200 });
});

t.test('a status sent in time whose answer never ends is no answer: the try times out, whatever the status, and the endpoint backs off', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const statuses = [200, 410, 500];
  const endpoints = new Map<string, number>();
  const keys = [];
  for (const [index, status] of statuses.entries()) {
    const receiver = await startReceiver(t, () => ({ status, unfinished: true }));
    endpoints.set((await addTestEndpoint(gateway, { project: `p${index}`, url: receiver.url })).id, status);
    keys.push(await gateway.createKey({ project: `p${index}` }));
  }
  const { runDueJobs } = testDeliverer(t, gateway, { webhooks: { timeoutMs: 300, retryScheduleMs: [] } });
  for (const key of keys) await endRequest(gateway, key, 'completed');
  await runDueJobs();
  await until(async () => (await messagesOf(gateway.db)).every((message) => message.finished_at !== null), 'all three tried', 5_000);
  for (const message of await messagesOf(gateway.db)) {
    const status = endpoints.get(message.endpoint_id)!;
    t.equal(message.status, 'failed', `HTTP ${status}: not delivered (the schedule has no retry)`);
    t.match(await triesOf(gateway.db, message.id), [
      { outcome: 'failed', http_status: status, error: `HTTP ${status} without the rest of its answer within 0.3 s` },
    ], `HTTP ${status}: a failed try`);
    const { rows } = await gateway.pool.query('select backoff_ms, disabled_at from gateway.webhook_endpoints where id = $1', [message.endpoint_id]);
    t.match(rows[0], { backoff_ms: 1_000, disabled_at: null }, `HTTP ${status}: its endpoint backs off (and is not disabled)`);
  }
});

t.test('410 disables the endpoint: its other messages are abandoned and nothing more is sent', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, () => ({ status: 410 }));
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  const { deliverer, metrics, runDueJobs } = testDeliverer(t, gateway);
  const first = await endRequest(gateway, key, 'completed');
  const second = await endRequest(gateway, key, 'failed');
  const [firstMessage] = await messagesOf(gateway.db, first);
  const [secondMessage] = await messagesOf(gateway.db, second);

  t.equal(await deliverer.deliver(firstMessage!.id), 'started');
  await until(async () => (await messagesOf(gateway.db, first))[0]!.status !== 'delivering', 'the try ended');
  const { rows } = await gateway.pool.query('select disabled_at, disabled_reason from gateway.webhook_endpoints where id = $1', [endpoint.id]);
  t.ok(rows[0].disabled_at, 'the endpoint is disabled');
  t.match(rows[0].disabled_reason, /410/);
  t.match(await messagesOf(gateway.db, first), [{ status: 'abandoned', tries: 1 }]);
  t.match(await triesOf(gateway.db, firstMessage!.id), [{ outcome: 'failed', http_status: 410 }]);
  t.match(await messagesOf(gateway.db, second), [{ status: 'abandoned', tries: 0 }], 'its other message, never tried, is abandoned');
  t.ok((await messagesOf(gateway.db, second))[0]!.finished_at);

  t.same(await runDueJobs(), ['nothing', 'nothing'], 'the two messages\' jobs (the first was run by hand) find nothing to do');
  await endRequest(gateway, key, 'completed');
  t.equal((await messagesOf(gateway.db)).length, 2, 'a request ending now writes no message for a disabled endpoint');
  t.equal(receiver.deliveries.length, 1, 'the receiver got one delivery, the one it answered 410');
  t.equal(await metricValue(metrics, 'gateway_webhook_deliveries_total{outcome="disabled"}'), 1);

  // A message written before the endpoint was disabled, tried after: abandoned, not sent.
  const other = await gateway.createKey({ project: 'other' });
  const otherEndpoint = await addTestEndpoint(gateway, { project: 'other', url: receiver.url });
  const late = await endRequest(gateway, other, 'completed');
  await gateway.pool.query(`update gateway.webhook_endpoints set disabled_at = now(), disabled_reason = 'test' where id = $1`, [otherEndpoint.id]);
  const [lateMessage] = await messagesOf(gateway.db, late);
  t.equal(await deliverer.deliver(lateMessage!.id), 'abandoned');
  t.match(await messagesOf(gateway.db, late), [{ status: 'abandoned', tries: 0 }]);
  t.equal(receiver.deliveries.length, 1, 'nothing sent');
});

t.test('without WEBHOOK_ALLOW_PRIVATE, loopback is refused before any TCP connection: a name in its lookup, an IP literal before connecting', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const receiver = await startReceiver(t);
  const byName = await gateway.createKey({ project: 'by-name' });
  const byAddress = await gateway.createKey({ project: 'by-address' });
  // A name passes the check made when the endpoint is added (https, as required without WEBHOOK_ALLOW_PRIVATE).
  const { addEndpoint } = await import('../../src/webhooks/endpoints.ts');
  await addEndpoint(gateway.db, { encryptionKey: gateway.config.secretEncryptionKeys[0], allowPrivate: false }, {
    project: 'by-name',
    url: `https://localhost:${receiver.port}/hooks`,
  });
  // An IP literal does not (it was added while WEBHOOK_ALLOW_PRIVATE was on). The receiver speaks
  // plain HTTP: a TLS handshake with it would fail before any check made once connected.
  await addTestEndpoint(gateway, { project: 'by-address', url: `https://127.0.0.1:${receiver.port}/hooks` });
  const { runDueJobs } = testDeliverer(t, gateway, { webhooks: { allowPrivate: false, retryScheduleMs: [60_000] } });
  const nameRequest = await endRequest(gateway, byName, 'completed');
  const addressRequest = await endRequest(gateway, byAddress, 'completed');
  await runDueJobs();
  await until(async () => (await messagesOf(gateway.db)).every((message) => message.tries === 1 && message.status === 'pending'), 'both tries ended');

  const [nameMessage] = await messagesOf(gateway.db, nameRequest);
  const [addressMessage] = await messagesOf(gateway.db, addressRequest);
  t.match(
    (await triesOf(gateway.db, nameMessage!.id))[0],
    { outcome: 'failed', http_status: null, error: /^the endpoint resolves to a private address \((127\.0\.0\.1|::1)\); WEBHOOK_ALLOW_PRIVATE is off$/ },
  );
  t.match(
    (await triesOf(gateway.db, addressMessage!.id))[0],
    { outcome: 'failed', http_status: null, error: 'the endpoint resolves to a private address (127.0.0.1); WEBHOOK_ALLOW_PRIVATE is off' },
  );
  t.ok(nameMessage!.next_try_at && addressMessage!.next_try_at, 'each retried on the schedule, like any failure');
  t.equal(receiver.deliveries.length, 0, 'the receiver got no request');
  t.equal(receiver.connections, 0, 'neither got a TCP connection to it');
});

t.test('each try checks the URL\'s scheme: an endpoint changed in the database to http:// or file:// gets no try', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const receiver = await startReceiver(t);
  const plain = await gateway.createKey({ project: 'plain' });
  const file = await gateway.createKey({ project: 'file' });
  // Both added as https://, then changed where only the database checks nothing.
  const plainEndpoint = await addTestEndpoint(gateway, { project: 'plain', url: `https://localhost:${receiver.port}/hooks` });
  const fileEndpoint = await addTestEndpoint(gateway, { project: 'file', url: `https://localhost:${receiver.port}/hooks` });
  await gateway.pool.query('update gateway.webhook_endpoints set url = $2 where id = $1', [plainEndpoint.id, receiver.url]);
  await gateway.pool.query(`update gateway.webhook_endpoints set url = 'file:///etc/passwd' where id = $1`, [fileEndpoint.id]);

  const strict = testDeliverer(t, gateway, { webhooks: { allowPrivate: false, retryScheduleMs: [60_000] } });
  const plainRequest = await endRequest(gateway, plain, 'completed');
  const fileRequest = await endRequest(gateway, file, 'completed');
  await strict.runDueJobs();
  await until(async () => (await messagesOf(gateway.db)).every((message) => message.tries === 1 && message.status === 'pending'), 'both tries ended');
  const [plainMessage] = await messagesOf(gateway.db, plainRequest);
  const [fileMessage] = await messagesOf(gateway.db, fileRequest);
  t.match(await triesOf(gateway.db, plainMessage!.id), [
    { outcome: 'failed', http_status: null, error: 'the endpoint URL must be https:// (it is http:); WEBHOOK_ALLOW_PRIVATE is off' },
  ]);
  t.match(await triesOf(gateway.db, fileMessage!.id), [
    { outcome: 'failed', http_status: null, error: 'the endpoint URL must be https:// (it is file:); WEBHOOK_ALLOW_PRIVATE is off' },
  ]);
  t.ok(plainMessage!.next_try_at && fileMessage!.next_try_at, 'each retried on the schedule, like any failure');

  // With WEBHOOK_ALLOW_PRIVATE, http:// is delivered to, and file:// still refused.
  const relaxed = testDeliverer(t, gateway, { webhooks: { allowPrivate: true, retryScheduleMs: [60_000] } });
  await gateway.pool.query('update gateway.webhook_messages set next_try_at = now()');
  await gateway.pool.query(
    `select graphile_worker.add_job('deliver_webhook', json_build_object('message_id', id)) from gateway.webhook_messages`,
  );
  await relaxed.runDueJobs();
  await until(async () => (await messagesOf(gateway.db)).every((message) => message.tries === 2 && message.status !== 'delivering'), 'both second tries ended');
  t.match(await messagesOf(gateway.db, plainRequest), [{ status: 'delivered' }]);
  t.match((await triesOf(gateway.db, fileMessage!.id))[1], {
    outcome: 'failed',
    error: 'the endpoint URL must be https:// or http:// (it is file:)',
  });
  t.equal(receiver.connections, 1, 'the receiver saw only the delivery WEBHOOK_ALLOW_PRIVATE allows');
});

t.test('a rotated secret: both sign during the overlap, each verifying on its own; afterwards only the new one', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t);
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  const rotated = await rotateSecret(gateway.db, gateway.config.secretEncryptionKeys[0], endpoint.id);
  t.ok(rotated);
  t.not(rotated!.secret, endpoint.secret);
  const overlap = rotated!.previous_secret_expires_at.getTime() - Date.now();
  t.ok(overlap > 23.9 * 3600_000 && overlap <= 24 * 3600_000, 'the old secret signs for 24 h more');
  receiver.secrets = [endpoint.secret, rotated!.secret];
  const { runDueJobs } = testDeliverer(t, gateway);

  await endRequest(gateway, key, 'completed');
  await runDueJobs();
  await until(() => receiver.deliveries.length === 1, 'delivered');
  const during = receiver.deliveries[0]!;
  t.equal(String(during.headers['webhook-signature']).split(' ').length, 2, 'two signatures, space-separated');
  t.same(during.verifiedWith, [0, 1], 'standardwebhooks verifies it with the old secret, and with the new one');

  await gateway.pool.query(`update gateway.webhook_endpoints set previous_secret_expires_at = now() - interval '1 second'`);
  await endRequest(gateway, key, 'failed');
  await runDueJobs();
  await until(() => receiver.deliveries.length === 2, 'delivered');
  const after = receiver.deliveries[1]!;
  t.equal(String(after.headers['webhook-signature']).split(' ').length, 1, 'one signature');
  t.same(after.verifiedWith, [1], 'the new secret only');
});

t.test('at WEBHOOK_MAX_IN_FLIGHT a message waits without a job of its own, keeping its tries; a try ending here takes it at once', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, () => ({ hang: true }));
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  const { deliverer, metrics, runDueJobs } = testDeliverer(t, gateway, { webhooks: { maxInFlight: 1 } });
  const first = await endRequest(gateway, key, 'completed');
  const second = await endRequest(gateway, key, 'completed');
  const third = await endRequest(gateway, key, 'failed');
  const [firstMessage] = await messagesOf(gateway.db, first);
  const [secondMessage] = await messagesOf(gateway.db, second);
  const [thirdMessage] = await messagesOf(gateway.db, third);
  await gateway.pool.query(`delete from graphile_worker._private_jobs`);

  t.equal(await deliverer.deliver(firstMessage!.id, endpoint.id), 'started');
  const before = Date.now();
  t.equal(await deliverer.deliver(secondMessage!.id, endpoint.id), 'deferred', 'no room: the job ends at once');
  t.equal(await deliverer.deliver(thirdMessage!.id, endpoint.id), 'deferred');
  t.equal(deliverer.inFlight, 1);
  t.match(await messagesOf(gateway.db, second), [{ status: 'pending', tries: 0 }], 'the message was not claimed: no try spent');
  t.same(await deliveryJobs(gateway.db), [], 'no job of its own is added again');
  const wakes = await wakeJobs(gateway.db);
  t.equal(wakes.length, 1, 'one wake job for the endpoint, however many messages wait');
  t.match(wakes[0], { endpoint_id: endpoint.id, deferrals: 0 });
  t.ok(wakes[0]!.run_at.getTime() >= before + 500 && wakes[0]!.run_at.getTime() <= Date.now() + 1_500, 'due about a second later');
  t.equal(await metricValue(metrics, 'gateway_webhook_deferrals_total{reason="worker_busy"}'), 2);

  receiver.release({ status: 204 });
  await until(async () => (await messagesOf(gateway.db)).every((message) => message.status === 'delivered'), 'all delivered, no job run');
  t.match(await messagesOf(gateway.db, second), [{ status: 'delivered', tries: 1 }], 'with its first try');
  // The last try's room is given back once its recording has returned, a moment after the row
  // says delivered: a wake before that would find no room.
  await until(() => deliverer.inFlight === 0 && deliverer.inFlightTo(endpoint.id) === 0, 'the last try landed');
  t.same(await runDueJobs(), [], 'the wake job is not due yet');
  await gateway.pool.query(`update graphile_worker._private_jobs set run_at = now()`);
  t.same(await runDueJobs(), ['nothing'], 'when it runs, nothing waits any more');
  t.same(await wakeJobs(gateway.db), [], 'and it is not added again');
});

t.test('WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT: an endpoint that does not answer holds that many tries of a worker; another endpoint\'s start at once', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const slowKey = await gateway.createKey({ project: 'slow' });
  const quickKey = await gateway.createKey({ project: 'quick' });
  const slow = await startReceiver(t, () => ({ hang: true }));
  const quick = await startReceiver(t);
  const slowEndpoint = await addTestEndpoint(gateway, { project: 'slow', url: slow.url });
  await addTestEndpoint(gateway, { project: 'quick', url: quick.url });
  const { deliverer, metrics, runDueJobs } = testDeliverer(t, gateway, { webhooks: { maxInFlight: 20, maxInFlightPerEndpoint: 3, timeoutMs: 10_000 } });
  for (let i = 0; i < 10; i++) await endRequest(gateway, slowKey, 'completed');
  for (let i = 0; i < 3; i++) await endRequest(gateway, quickKey, 'completed');

  const said = await runDueJobs();
  t.equal(said.filter((word) => word === 'started').length, 3 + 3, 'three of the slow endpoint\'s, the other\'s three');
  t.equal(said.filter((word) => word === 'deferred').length, 7);
  await until(() => quick.deliveries.length === 3, 'the other endpoint got its three');
  await sleep(200);
  t.equal(slow.deliveries.length, 3, 'the slow endpoint holds three tries, no more');
  t.equal(slow.maxOpen, 3);
  t.equal(deliverer.inFlightTo(slowEndpoint.id), 3);
  t.equal(await metricValue(metrics, 'gateway_webhook_deferrals_total{reason="endpoint_busy"}'), 7);
  t.equal((await wakeJobs(gateway.db)).length, 1, 'its seven waiting messages share one wake job');

  slow.release({ status: 204 });
  await until(async () => (await messagesOf(gateway.db)).every((message) => message.status === 'delivered'), 'all delivered', 5_000);
  t.equal(slow.maxOpen, 3, 'three at a time to the slow endpoint, as each try ending here took the next');
  t.same(new Set((await messagesOf(gateway.db)).map((message) => message.tries)), new Set([1]), 'each with one try: waiting spent none');
});

t.test('an endpoint that times out backs off: no try for 1 s, then one probe at a time, the wait doubling; an answer ends it', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, () => ({ hang: true }));
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  const { metrics, runDueJobs } = testDeliverer(t, gateway, { webhooks: { timeoutMs: 300, retryScheduleMs: [100, 100, 100, 100, 100] } });
  for (let i = 0; i < 4; i++) await endRequest(gateway, key, 'completed');
  const backoff = async () =>
    (await gateway.pool.query('select backoff_ms, timed_out_at, paused_until from gateway.webhook_endpoints where id = $1', [endpoint.id])).rows[0];

  t.same(await runDueJobs(), ['started', 'started', 'started', 'started']);
  await until(async () => (await backoff()).backoff_ms !== null, 'the endpoint backs off');
  await until(async () => (await messagesOf(gateway.db)).every((message) => message.status === 'pending'), 'the four tries timed out');
  const first = await backoff();
  t.equal(first.backoff_ms, 1_000, 'four tries timed out together: one step, a wait of 1 s');
  t.equal(first.paused_until.getTime() - first.timed_out_at.getTime(), 1_000);

  // Their retries are due in 100 ms: they find the endpoint paused, and wait without spending a try.
  await sleep(150);
  t.same(await runDueJobs(), ['deferred', 'deferred', 'deferred', 'deferred']);
  t.same(new Set((await messagesOf(gateway.db)).map((message) => message.tries)), new Set([1]), 'no try spent while it waits');
  t.equal(await metricValue(metrics, 'gateway_webhook_deferrals_total{reason="endpoint_backing_off"}'), 4);
  const wakes = await wakeJobs(gateway.db);
  t.equal(wakes.length, 1);
  t.equal(wakes[0]!.run_at.getTime(), first.paused_until.getTime(), 'its wake is due when the wait ends');

  await until(async () => (await runDueJobs()).length > 0, 'the wake ran', 2_000);
  await until(() => receiver.deliveries.length === 5, 'the probe arrived');
  await sleep(100);
  t.equal(receiver.deliveries.length, 5, 'one probe, not four tries');
  await until(async () => (await backoff()).backoff_ms === 2_000, 'the probe timed out: the wait doubles', 2_000);
  const second = await backoff();
  t.equal(second.paused_until.getTime() - second.timed_out_at.getTime(), 2_000);
  t.same(await runDueJobs(), [], 'nothing runs during the wait');

  receiver.release({ status: 204 });
  await until(
    async () => {
      await runDueJobs();
      return (await messagesOf(gateway.db)).every((message) => message.status === 'delivered');
    },
    'the next probe is answered, and the others go at once',
    5_000,
  );
  t.same(await backoff(), { backoff_ms: null, timed_out_at: null, paused_until: null }, 'the answer ended the backoff');
  const tries = (await messagesOf(gateway.db)).map((message) => message.tries).sort();
  t.equal(tries.reduce((sum, n) => sum + n, 0), receiver.deliveries.length, 'every try reached the endpoint: waiting spent none');
  t.same(tries, [2, 2, 2, 3], 'the first tries, the probe that timed out, the one answered, then the three others');
});

t.test('workers claiming at the same moment start one probe of an endpoint whose wait is over', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, () => ({ hang: true }));
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  for (let i = 0; i < 6; i++) await endRequest(gateway, key, 'completed');
  await gateway.pool.query(`delete from graphile_worker._private_jobs`);
  await gateway.pool.query(
    `update gateway.webhook_endpoints set backoff_ms = 4000, timed_out_at = now() - interval '5 seconds', paused_until = now() - interval '1 second' where id = $1`,
    [endpoint.id],
  );
  const workers = [testDeliverer(t, gateway).deliverer, testDeliverer(t, gateway).deliverer];
  const messages = await messagesOf(gateway.db);
  const said = await Promise.all([
    ...messages.map((message, i) => workers[i % 2]!.deliver(message.id, endpoint.id)),
    workers[0]!.wake(endpoint.id, 0),
    workers[1]!.wake(endpoint.id, 0),
  ]);
  t.equal(said.filter((word) => word === 'started').length, 1, `one probe (${said.join(', ')})`);
  const { rows } = await gateway.pool.query('select paused_until from gateway.webhook_endpoints where id = $1', [endpoint.id]);
  t.ok(rows[0].paused_until.getTime() > Date.now() + 1_000, 'the probe keeps the others off for its length');
  t.equal((await messagesOf(gateway.db)).filter((message) => message.status === 'delivering').length, 1);
  t.equal((await wakeJobs(gateway.db)).length, 1, 'the others wait for one wake');
  receiver.release({ status: 204 });
});

t.test('a wake that finds no room comes back later each time: 1 s, 2 s, 4 s ... up to a minute', async (t) => {
  t.same([0, 1, 2, 3, 4, 5, 6, 7, 50].map(wakeDelay), [1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 60_000, 60_000, 60_000]);
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, () => ({ hang: true }));
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  const { deliverer, runDueJobs } = testDeliverer(t, gateway, { webhooks: { maxInFlightPerEndpoint: 1, timeoutMs: 10_000 } });
  for (let i = 0; i < 3; i++) await endRequest(gateway, key, 'completed');
  t.same((await runDueJobs()).sort(), ['deferred', 'deferred', 'started']);
  for (const deferrals of [0, 1, 2]) {
    const [wake] = await wakeJobs(gateway.db);
    t.equal(wake?.deferrals, deferrals);
    await gateway.pool.query(`delete from graphile_worker._private_jobs`);
    const before = Date.now();
    t.equal(await deliverer.wake(endpoint.id, deferrals), 'deferred', 'no room: its messages still wait');
    const [next] = await wakeJobs(gateway.db);
    const delay = next!.run_at.getTime() - before;
    t.ok(delay >= wakeDelay(deferrals + 1) - 100 && delay <= wakeDelay(deferrals + 1) + 1_000, `the next in ${delay} ms`);
  }
  t.equal(receiver.deliveries.length, 1);
  t.same((await messagesOf(gateway.db)).map((message) => message.tries).sort(), [0, 0, 1], 'the two waiting spent no try');
  receiver.release({ status: 204 });
});

t.test('a worker without SECRET_ENCRYPTION_KEY leaves messages pending, says so once, and does not crash', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t);
  await addTestEndpoint(gateway, { url: receiver.url });
  const { logs, runDueJobs } = testDeliverer(t, gateway, { secretEncryptionKey: undefined });
  await endRequest(gateway, key, 'completed');
  await endRequest(gateway, key, 'failed');
  t.same(await runDueJobs(), ['deferred', 'deferred']);
  t.match(await messagesOf(gateway.db), [{ status: 'pending', tries: 0 }, { status: 'pending', tries: 0 }]);
  const jobs = await deliveryJobs(gateway.db);
  t.equal(jobs.length, 2, 'their jobs come back');
  t.ok(jobs.every((job) => job.run_at.getTime() > Date.now() + 50_000), 'a minute later');
  const errors = logs.filter((line) => line.level === 'error');
  t.equal(errors.length, 1, 'one error logged, not one per message');
  t.match(errors[0]?.msg, /SECRET_ENCRYPTION_KEY is not set/);
  t.equal(receiver.deliveries.length, 0);
});

t.test('a worker without the key an endpoint\'s secret was stored with spends none of its retries: the event waits, later each time, for a worker that has it', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t);
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  receiver.secrets = [endpoint.secret];
  // A first wait of 100 ms, and a span (an hour) that the event stays well within.
  const webhooks = { retryScheduleMs: [100, 60 * 60_000] };
  // Mid-rotation: this worker has a key, but not the one the endpoint's secret is encrypted with.
  const keyless = testDeliverer(t, gateway, { webhooks, secretEncryptionKey: randomBytes(32) });
  await endRequest(gateway, key, 'completed');
  const [message] = await messagesOf(gateway.db);

  const delays: number[] = [];
  for (let round = 1; round <= 3; round++) {
    t.same(await keyless.runDueJobs(), ['started'], `round ${round}: claimed`);
    await until(async () => (await messagesOf(gateway.db))[0]!.status !== 'delivering', `round ${round}: the try ended`);
    const [after] = await messagesOf(gateway.db);
    t.match(after, { status: 'pending', tries: round, failures: 0 }, `round ${round}: pending still, no retry spent`);
    const [job] = await deliveryJobs(gateway.db);
    t.equal(job?.run_at.getTime(), after!.next_try_at!.getTime(), `round ${round}: its job is due when it is`);
    delays.push(after!.next_try_at!.getTime() - Date.now());
    // (its wait cut short, so that the test goes on)
    await gateway.pool.query(`update gateway.webhook_messages set next_try_at = now() where id = $1`, [message!.id]);
    await gateway.pool.query(`update graphile_worker._private_jobs set run_at = now()`);
  }
  t.ok(delays[0]! > 30_000, `deferred well beyond the schedule's 100 ms (${delays[0]} ms)`);
  t.ok(delays[1]! > delays[0]! && delays[2]! > delays[1]!, `later each time (${delays.join(', ')} ms)`);
  t.equal(receiver.deliveries.length, 0, 'nothing reached the receiver');
  t.match(await triesOf(gateway.db, message!.id), [
    { try_number: 1, outcome: 'failed', http_status: null, error: /secret could not be decrypted/ },
    { try_number: 2, outcome: 'failed' },
    { try_number: 3, outcome: 'failed' },
  ]);
  const errors = keyless.logs.filter((line) => line.level === 'error');
  t.equal(errors.length, 3, 'an error logged for each such try');
  t.ok(errors.every((line) => line.endpointId === endpoint.id), 'naming the endpoint');
  const secretBody = endpoint.secret.slice('whsec_'.length);
  t.notOk(keyless.logs.some((line) => JSON.stringify(line).includes(secretBody)), 'never its secret');

  // A worker with the key delivers it.
  const keyed = testDeliverer(t, gateway, { webhooks });
  t.same(await keyed.runDueJobs(), ['started']);
  await until(async () => (await messagesOf(gateway.db))[0]!.status === 'delivered', 'delivered by a worker with the key');
  t.equal(receiver.deliveries.length, 1);
  t.same(receiver.deliveries[0]?.verifiedWith, [0]);
});

t.test('an event no worker could sign is given up once it is older than the whole retry schedule, as a spent schedule gives it up', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t);
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  // Waits of 1 min and 2 min: the schedule spans 3 min.
  const webhooks = { retryScheduleMs: [60_000, 120_000] };
  // The key the endpoint's secret was stored with is lost: no worker has it.
  const keyless = testDeliverer(t, gateway, { webhooks, secretEncryptionKey: randomBytes(32) });
  await endRequest(gateway, key, 'completed');
  const [message] = await messagesOf(gateway.db);

  t.same(await keyless.runDueJobs(), ['started']);
  await until(async () => (await messagesOf(gateway.db))[0]!.status !== 'delivering', 'the first try ended');
  t.match((await messagesOf(gateway.db))[0], { status: 'pending', tries: 1, failures: 0 }, 'younger than the schedule: it waits, no retry spent');

  // Its wait cut short, and the event made older than the schedule's span.
  await gateway.pool.query(
    `update gateway.webhook_messages set next_try_at = now(), created_at = now() - interval '4 minutes' where id = $1`,
    [message!.id],
  );
  await gateway.pool.query(`update graphile_worker._private_jobs set run_at = now()`);
  t.same(await keyless.runDueJobs(), ['started']);
  await until(async () => (await messagesOf(gateway.db))[0]!.status !== 'delivering', 'the second try ended');
  const [after] = await messagesOf(gateway.db);
  t.match(after, { status: 'failed', tries: 2, failures: 0, next_try_at: null, worker_id: null }, 'given up (failed)');
  t.ok(after!.finished_at, 'finished: retention no longer keeps its request');
  t.match(await triesOf(gateway.db, message!.id), [
    { try_number: 1, outcome: 'failed', http_status: null, error: /secret could not be decrypted/ },
    { try_number: 2, outcome: 'failed', http_status: null, error: /secret could not be decrypted/ },
  ]);
  t.same(await deliveryJobs(gateway.db), [], 'no try is left to make');
  t.same(await keyless.runDueJobs(), []);
  t.equal(receiver.deliveries.length, 0, 'nothing reached the receiver');
  const errors = keyless.logs.filter((line) => line.level === 'error');
  t.equal(errors.length, 2, 'an error logged for each such try');
  t.match(errors[1], { endpointId: endpoint.id, messageId: message!.id, msg: /given up/ }, 'the last says the event is given up');
  t.equal(await metricValue(keyless.metrics, 'gateway_webhook_deliveries_total{outcome="failed"}'), 2);
});

t.test('a job whose message is gone, finished or not due does nothing; removing an endpoint removes its messages', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t);
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  const { deliverer } = testDeliverer(t, gateway);
  t.equal(await deliverer.deliver('msg_00000000000000000000000000000000'), 'nothing', 'an unknown message');

  const delivered = await endRequest(gateway, key, 'completed');
  const [message] = await messagesOf(gateway.db, delivered);
  t.equal(await deliverer.deliver(message!.id), 'started');
  await until(async () => (await messagesOf(gateway.db, delivered))[0]!.status === 'delivered', 'delivered');
  t.equal(await deliverer.deliver(message!.id), 'nothing', 'a delivered message is not sent again');

  const later = await endRequest(gateway, key, 'failed');
  await gateway.pool.query(`update gateway.webhook_messages set next_try_at = now() + interval '1 hour' where request_id = $1`, [later]);
  const [laterMessage] = await messagesOf(gateway.db, later);
  t.equal(await deliverer.deliver(laterMessage!.id), 'nothing', 'a message not due yet');

  const removed = await removeEndpoint(gateway.db, endpoint.id);
  t.equal(removed?.undelivered_messages, 1);
  t.same(await messagesOf(gateway.db), [], 'its messages went with it');
  t.equal((await gateway.pool.query('select count(*)::int as n from gateway.webhook_deliveries')).rows[0].n, 0, 'and their tries');
  t.equal(await deliverer.deliver(laterMessage!.id), 'nothing', 'a removed endpoint\'s message');
  t.equal(receiver.deliveries.length, 1);
});

t.test('tries lost with their worker are handed back by the sweep: recorded failed, retried at once with the same webhook-id', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t);
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  receiver.secrets = [endpoint.secret];
  const own = 'worker-own';
  const { deliverer, metrics, runDueJobs } = testDeliverer(t, gateway, { workerId: own });
  await gateway.pool.query(`insert into gateway.worker_pools (id, hostname, pid) values ('worker-alive', 'h', 1), ($1, 'h', 2)`, [own]);

  const requests = { dead: '', young: '', alive: '', own: '' };
  for (const name of Object.keys(requests) as (keyof typeof requests)[]) {
    requests[name] = await endRequest(gateway, key, 'completed');
    const [message] = await messagesOf(gateway.db, requests[name]);
    const workerId = { dead: 'worker-dead', young: 'worker-dead', alive: 'worker-alive', own }[name];
    t.equal((await claimMessage(gateway.db, message!.id, workerId, 3_000)).kind, 'claimed');
    if (name !== 'young') {
      await gateway.pool.query(`update gateway.webhook_deliveries set started_at = now() - interval '1 minute' where message_id = $1`, [message!.id]);
    }
  }
  await gateway.pool.query(`delete from graphile_worker._private_jobs`);

  t.equal(await deliverer.recoverLost(10_000, [own]), 1, 'one lost try');
  const [dead] = await messagesOf(gateway.db, requests.dead);
  t.match(dead, { status: 'pending', tries: 1, worker_id: null, finished_at: null });
  t.ok(dead!.next_try_at!.getTime() <= Date.now() + 1_000, 'due at once');
  t.match(await triesOf(gateway.db, dead!.id), [{ try_number: 1, outcome: 'failed', error: 'the worker stopped during the try' }]);
  t.same((await deliveryJobs(gateway.db)).map((job) => job.message_id), [dead!.id], 'with a job');
  for (const name of ['young', 'alive', 'own'] as const) {
    t.match(await messagesOf(gateway.db, requests[name]), [{ status: 'delivering' }], `not ${name}: ${{ young: 'its try started less than WORKER_DEAD_AFTER_MS ago', alive: 'its worker beats', own: 'the caller\'s own' }[name]}`);
  }
  t.equal(await metricValue(metrics, 'gateway_webhook_deliveries_total{outcome="failed"}'), 1);

  t.same(await runDueJobs(), ['started']);
  await until(async () => (await messagesOf(gateway.db, requests.dead))[0]!.status === 'delivered', 'delivered');
  t.match(await triesOf(gateway.db, dead!.id), [{ outcome: 'failed' }, { try_number: 2, outcome: 'succeeded' }]);
  t.equal(receiver.deliveries[0]?.headers['webhook-id'], dead!.id, 'with the message\'s webhook-id');
  t.same(receiver.deliveries[0]?.verifiedWith, [0]);
  t.equal(await deliverer.recoverLost(10_000, [own]), 0, 'a second sweep finds nothing');
  t.equal(await deliverer.recoverLost(10_000, [own], 1_000, ['worker-dead']), 1, 'but one that has just found worker-dead dead takes its young try too');
  t.match(await messagesOf(gateway.db, requests.young), [{ status: 'pending', worker_id: null }]);
  for (const name of ['alive', 'own'] as const) t.match(await messagesOf(gateway.db, requests[name]), [{ status: 'delivering' }], `and still not ${name}`);
});

t.test('at shutdown a try in flight gets the grace time, then is aborted and retried at once; later jobs are handed back', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, () => ({ hang: true }));
  await addTestEndpoint(gateway, { url: receiver.url });
  const first = testDeliverer(t, gateway, { shutdownGraceMs: 300 });
  const cut = await endRequest(gateway, key, 'completed');
  const waiting = await endRequest(gateway, key, 'failed');
  const [cutMessage] = await messagesOf(gateway.db, cut);
  const [waitingMessage] = await messagesOf(gateway.db, waiting);
  await gateway.pool.query(`delete from graphile_worker._private_jobs`);

  t.equal(await first.deliverer.deliver(cutMessage!.id), 'started');
  await until(() => receiver.deliveries.length === 1, 'the receiver holds the try');
  const stopping = Date.now();
  await first.deliverer.stop();
  // The receiver never answers: the try's end, recorded as the shutdown's, is stop()'s abort,
  // given no sooner than the grace time after stop() was called.
  const tries = await triesOf(gateway.db, cutMessage!.id);
  t.match(tries, [{ try_number: 1, outcome: 'failed', error: 'the worker shut down during the try' }], 'stop() aborted the try');
  const endedAfter = tries[0]!.finished_at!.getTime() - stopping;
  t.ok(endedAfter >= 280, `stop() gave the try its grace time (300 ms) first: it ended ${endedAfter} ms after stop() was called`);
  const [afterStop] = await messagesOf(gateway.db, cut);
  t.match(afterStop, { status: 'pending', tries: 1 });
  t.ok(afterStop!.next_try_at!.getTime() <= Date.now(), 'due at once');

  t.equal(await first.deliverer.deliver(waitingMessage!.id), 'deferred', 'a stopped deliverer takes nothing');
  t.match(await messagesOf(gateway.db, waiting), [{ status: 'pending', tries: 0 }]);
  t.same((await deliveryJobs(gateway.db)).map((job) => job.message_id).sort(), [cutMessage!.id, waitingMessage!.id].sort(), 'both have a job due now, for another worker');

  receiver.release({ status: 204 });
  const second = testDeliverer(t, gateway);
  await second.runDueJobs();
  await until(async () => (await messagesOf(gateway.db)).every((message) => message.status === 'delivered'), 'both delivered by another worker');
  const ids = receiver.deliveries.map((delivery) => delivery.headers['webhook-id']);
  t.equal(ids.filter((id) => id === cutMessage!.id).length, 2, 'the cut try was made again, with the same webhook-id');
});

t.test('a try lost with its worker, or cut short by a shutdown, spends no retry: the endpoint still gets every try of the schedule', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const ids = { lost: '', cut: '' };
  const receiver = await startReceiver(t, (delivery) =>
    delivery.headers['webhook-id'] === ids.cut && receiver.deliveries.filter((d) => d.headers['webhook-id'] === ids.cut).length === 1
      ? { hang: true }
      : { status: 502 },
  );
  await addTestEndpoint(gateway, { url: receiver.url });
  const webhooks = { retryScheduleMs: [100, 200] };
  const lost = await endRequest(gateway, key, 'completed');
  const cut = await endRequest(gateway, key, 'failed');
  ids.lost = (await messagesOf(gateway.db, lost))[0]!.id;
  ids.cut = (await messagesOf(gateway.db, cut))[0]!.id;
  await gateway.pool.query(`delete from graphile_worker._private_jobs`);

  // The first try of one is lost with its worker, handed back by the sweep; the other's is cut short by its worker's shutdown.
  t.equal((await claimMessage(gateway.db, ids.lost, 'worker-dead', 3_000)).kind, 'claimed');
  await gateway.pool.query(`update gateway.webhook_deliveries set started_at = now() - interval '1 minute' where message_id = $1`, [ids.lost]);
  const first = testDeliverer(t, gateway, { webhooks, shutdownGraceMs: 100 });
  t.equal(await first.deliverer.recoverLost(10_000, []), 1);
  t.equal(await first.deliverer.deliver(ids.cut), 'started');
  await until(() => receiver.deliveries.length === 1, 'the receiver holds the try');
  await first.deliverer.stop();

  const second = testDeliverer(t, gateway, { webhooks });
  await until(
    async () => {
      await second.runDueJobs();
      return (await messagesOf(gateway.db)).every((message) => message.status === 'failed');
    },
    'both given up',
    10_000,
  );
  for (const [name, id] of Object.entries(ids)) {
    const tries = await triesOf(gateway.db, id);
    t.same(
      tries.map((row) => [row.try_number, row.http_status, row.error]),
      [
        [1, null, name === 'lost' ? 'the worker stopped during the try' : 'the worker shut down during the try'],
        [2, 502, 'HTTP 502'],
        [3, 502, 'HTTP 502'],
        [4, 502, 'HTTP 502'],
      ],
      `${name}: the try made again in its place, then one retry per entry of the schedule`,
    );
  }
});

t.test('gateway_webhook_oldest_pending_seconds is the age of the oldest message not finished', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t);
  await addTestEndpoint(gateway, { url: receiver.url });
  const { metrics, runDueJobs } = testDeliverer(t, gateway);
  metrics.watchWebhooks(() => oldestUnfinishedMessageAge(gateway.db));
  t.equal(await metricValue(metrics, 'gateway_webhook_oldest_pending_seconds'), 0, 'none: 0');
  await endRequest(gateway, key, 'completed');
  await gateway.db.updateTable('webhook_messages').set({ created_at: sql<Date>`now() - interval '90 seconds'` } as never).execute();
  const age = await metricValue(metrics, 'gateway_webhook_oldest_pending_seconds');
  t.ok(age >= 90 && age < 100, `${age} s`);
  await runDueJobs();
  await until(async () => (await messagesOf(gateway.db))[0]!.status === 'delivered', 'delivered');
  t.equal(await metricValue(metrics, 'gateway_webhook_oldest_pending_seconds'), 0, 'delivered: 0 again');
  await sleep(0);
});
