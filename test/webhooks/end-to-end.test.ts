// Webhooks through the whole gateway: requests accepted by the API, run by the worker, their
// events delivered by the worker's deliver_webhook jobs to a loopback receiver that verifies
// every delivery with the official standardwebhooks package.
import { sql } from 'kysely';
import t from 'tap';
import { rotateSecret, addEndpoint } from '../../src/webhooks/endpoints.ts';
import { startTestGateway, TEST_SETTINGS } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { spawnServe, type GatewayProcess } from '../helpers/serve.ts';
import { until } from '../helpers/wait.ts';
import { inBatches } from '../helpers/concurrency.ts';
import { addTestEndpoint, dataText, messagesOf, startReceiver, triesOf, type Delivery } from './support.ts';

/** Deliveries to loopback receivers, retried quickly. */
const WEBHOOK_SETTINGS = { WEBHOOK_ALLOW_PRIVATE: 'true', WEBHOOK_RETRY_SCHEDULE: '100,200,400' };

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

function tally(values: Iterable<string>): string {
  const counts = new Map<string, number>();
  for (const value of values) counts.set(value, (counts.get(value) ?? 0) + 1);
  return [...counts].sort(([a], [b]) => (a < b ? -1 : 1)).map(([value, n]) => `${value}: ${n}`).join(', ');
}

async function terminalCount(db: import('../../src/db/pool.ts').Db, ids: string[]): Promise<number> {
  const row = await db
    .selectFrom('requests')
    .select(sql<string>`count(*)`.as('count'))
    .where('id', 'in', ids)
    .where('finished_at', 'is not', null)
    .executeTakeFirstOrThrow();
  return Number(row.count);
}

t.test('1,000 requests of a test-mode mix: each that ends gets exactly one verified event of its final status, carrying its lookup record', async (t) => {
  const gateway = await startTestGateway(t, {
    env: { ...WEBHOOK_SETTINGS, UPSTREAM_TIMEOUT_MS: '60000', WORKER_CONCURRENCY: '32', WAIT_TIMEOUT_MS: '1000' },
  });
  const key = await gateway.createKey({ project: 'hooks' });
  const receiver = await startReceiver(t);
  const endpoint = await addTestEndpoint(gateway, { project: 'hooks', url: receiver.url });
  receiver.secrets = [endpoint.secret];
  const client = clientFor(gateway.url, key);

  // 7 in 10 complete, 2 in 10 fail, 1 in 10 is cancelled while it runs (30 s: long enough that
  // every cancel arrives first).
  const models = Array.from({ length: 1_000 }, (_, i) => (i % 10 < 7 ? 'test-echo' : i % 10 < 9 ? 'test-error-400' : 'test-delay-30000'));
  const accepted = await inBatches(models, 50, (model, i) => client.post({ model, messages: userMessage(`webhook mix ${i}`) }));
  t.equal(tally(accepted.map((answer) => String(answer.status))), '202: 1000', 'all 1,000 acknowledged');
  const ids = accepted.map((answer) => answer.body.id as string);
  const slow = ids.filter((_, i) => models[i] === 'test-delay-30000');
  const cancels = await inBatches(slow, 20, (id) => send(gateway.url, { method: 'POST', path: `/v1/requests/${id}/cancel`, key }));
  t.equal(tally(cancels.map((answer) => `${answer.status} ${answer.body?.status ?? answer.body?.error?.code}`)), '200 cancelled: 100', 'the 100 slow ones cancelled');

  await until(async () => (await terminalCount(gateway.db, ids)) === ids.length, 'every request ended', 60_000);
  await until(
    async () => {
      const { rows } = await gateway.pool.query(`select count(*)::int as n from gateway.webhook_messages where status = 'delivered'`);
      return rows[0].n === ids.length;
    },
    'every event delivered',
    60_000,
  );

  const records = await inBatches(ids, 50, (id) => client.get(id));
  const messages = await messagesOf(gateway.db);
  const messagesByRequest = new Map<string, typeof messages>();
  for (const message of messages) messagesByRequest.set(message.request_id, [...(messagesByRequest.get(message.request_id) ?? []), message]);
  const deliveriesById = new Map<string, Delivery[]>();
  for (const delivery of receiver.deliveries) {
    const id = String(delivery.headers['webhook-id']);
    deliveriesById.set(id, [...(deliveriesById.get(id) ?? []), delivery]);
  }

  const problems: string[] = [];
  ids.forEach((id, i) => {
    const record = records[i]!;
    const own = messagesByRequest.get(id) ?? [];
    if (own.length !== 1) return problems.push(`${id}: ${own.length} messages`);
    const message = own[0]!;
    const received = deliveriesById.get(message.id) ?? [];
    if (received.length === 0) return problems.push(`${id}: no delivery`);
    if (received.length > message.tries) problems.push(`${id}: ${received.length} deliveries in ${message.tries} tries`);
    for (const delivery of received) {
      if (delivery.verifiedWith.length !== 1) problems.push(`${id}: a delivery standardwebhooks did not verify`);
      if (delivery.event?.type !== `request.${record.body.status}`) problems.push(`${id}: event ${delivery.event?.type}, request ${record.body.status}`);
      if (dataText(delivery.body) !== record.text) problems.push(`${id}: data ${dataText(delivery.body).slice(0, 80)} is not the lookup record ${record.text.slice(0, 80)}`);
    }
  });
  t.same(problems.slice(0, 20), [], `each request: one message, delivered, verified, of its final status, with its lookup record (${problems.length} problems)`);
  t.equal(tally(records.map((record) => String(record.body.status))), 'cancelled: 100, completed: 700, failed: 200');
  t.equal(tally(messages.map((message) => message.event_type)), 'request.cancelled: 100, request.completed: 700, request.failed: 200');
  const known = new Set(messages.map((message) => message.id));
  t.same([...deliveriesById.keys()].filter((id) => !known.has(id)), [], 'no delivery for anything else');
  const duplicates = [...deliveriesById.values()].filter((received) => received.length > 1).length;
  t.comment(`${receiver.deliveries.length} deliveries for ${known.size} messages (${duplicates} received more than once, each a retry of the same webhook-id)`);
});

t.test('a receiver answering 500 three times then 200: four tries, spaced as the schedule says, then delivered', async (t) => {
  const gateway = await startTestGateway(t, { env: { ...WEBHOOK_SETTINGS, METRICS_PORT: '0' } });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, (delivery) => (delivery.count <= 3 ? { status: 500 } : { status: 200 }));
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  receiver.secrets = [endpoint.secret];
  const accepted = await clientFor(gateway.url, key).post({ model: 'test-echo', messages: userMessage(), wait: true });
  t.equal(accepted.status, 200);

  await until(async () => (await messagesOf(gateway.db))[0]?.status === 'delivered', 'delivered', 10_000);
  const [message] = await messagesOf(gateway.db);
  const tries = await triesOf(gateway.db, message!.id);
  t.same(tries.map((row) => [row.outcome, row.http_status]), [['failed', 500], ['failed', 500], ['failed', 500], ['succeeded', 200]], 'four tries: a row each in gateway.webhook_deliveries');
  const schedule = [100, 200, 400];
  tries.slice(1).forEach((row, index) => {
    const gap = row.started_at.getTime() - tries[index]!.started_at.getTime();
    t.ok(gap >= 0.9 * schedule[index]!, `retry ${index + 1} came ${gap} ms after the try before it (schedule: ${schedule[index]} ms ±10 %)`);
  });
  t.equal(receiver.deliveries.length, 4);
  t.ok(receiver.deliveries.every((delivery) => delivery.headers['webhook-id'] === message!.id && delivery.verifiedWith.length === 1), 'each with the same webhook-id, each verified');

  const metrics = (await send(gateway.metricsUrl, { path: '/metrics' })).text;
  t.match(metrics, /^gateway_webhook_deliveries_total\{outcome="failed"\} 3$/m);
  t.match(metrics, /^gateway_webhook_deliveries_total\{outcome="succeeded"\} 1$/m);
  t.match(metrics, /^gateway_webhook_oldest_pending_seconds 0$/m);
  const { rows } = await gateway.pool.query('select * from gateway.failing_webhook_endpoints');
  t.same(rows, [], 'a delivered endpoint is not failing');
});

t.test('a receiver answering 410: the endpoint is disabled, its other messages abandoned, nothing more sent', async (t) => {
  // One try in flight at a time, so the others wait while the receiver holds the first.
  const gateway = await startTestGateway(t, { env: { ...WEBHOOK_SETTINGS, WEBHOOK_MAX_IN_FLIGHT: '1' } });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, () => ({ hang: true }));
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  const client = clientFor(gateway.url, key);
  for (let i = 0; i < 5; i++) t.equal((await client.post({ model: 'test-echo', messages: userMessage(), wait: true })).status, 200);
  await until(async () => (await messagesOf(gateway.db)).length === 5 && receiver.deliveries.length === 1, 'five messages, one try held');
  receiver.release({ status: 410 });

  await until(async () => (await messagesOf(gateway.db)).every((message) => message.finished_at !== null), 'all finished', 10_000);
  const { rows } = await gateway.pool.query('select * from gateway.failing_webhook_endpoints');
  t.match(rows, [{ id: endpoint.id, project: 'test-project', disabled_reason: /410/, pending_messages: '0', last_failure_status: 410 }], 'the psql view shows it disabled');
  t.ok(rows[0].disabled_at);
  const messages = await messagesOf(gateway.db);
  t.equal(tally(messages.map((message) => `${message.status} after ${message.tries}`)), 'abandoned after 0: 4, abandoned after 1: 1', 'the one tried, and the four others, abandoned');

  await client.post({ model: 'test-echo', messages: userMessage(), wait: true });
  await sleep(1_500);
  t.equal((await messagesOf(gateway.db)).length, 5, 'a request ending later writes no message');
  t.equal(receiver.deliveries.length, 1, 'the receiver got nothing after its 410');
});

t.test('a worker SIGKILLed during its tries: after a new worker starts, every event is delivered, the cut ones with their webhook-id, those that waited for room with their first try', async (t) => {
  const api = await startTestGateway(t, { role: 'api', env: WEBHOOK_SETTINGS });
  const key = await api.createKey();
  const receiver = await startReceiver(t, () => ({ hang: true }));
  const endpoint = await addTestEndpoint(api, { url: receiver.url });
  receiver.secrets = [endpoint.secret];
  const env = {
    ...TEST_SETTINGS,
    ...WEBHOOK_SETTINGS,
    DATABASE_URL: api.databaseUrl,
    SECRET_ENCRYPTION_KEY: api.config.secretEncryptionKeys[0]!.toString('base64'),
    WORKER_DEAD_AFTER_MS: '1000',
  };
  const started = async (worker: GatewayProcess) => until(() => worker.output().includes('gateway started'), () => `the worker started:\n${worker.output()}`, 30_000);
  const first = spawnServe(t, env, ['--role', 'worker']);
  await started(first);

  const client = clientFor(api.url, key);
  const accepted = await inBatches(Array.from({ length: 20 }, (_, i) => i), 10, (i) => client.post({ model: 'test-echo', messages: userMessage(`kill ${i}`) }));
  const ids = accepted.map((answer) => answer.body.id as string);
  // WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT (10): the receiver holds ten tries, the ten others wait.
  await until(
    async () => receiver.deliveries.length === 10 && (await messagesOf(api.db)).filter((message) => message.tries === 0).length === 10,
    () => `ten tries reached the receiver (${receiver.deliveries.length}), ten messages wait`,
    20_000,
  );
  const cut = new Set(receiver.deliveries.map((delivery) => String(delivery.headers['webhook-id'])));
  t.equal(tally((await messagesOf(api.db)).map((message) => `${message.status} after ${message.tries}`)), 'delivering after 1: 10, pending after 0: 10', 'ten tries held by the receiver, ten messages waiting');

  t.equal((await first.kill('SIGKILL'))?.code, null, 'the worker died of SIGKILL');
  receiver.release({ status: 204 });
  const second = spawnServe(t, env, ['--role', 'worker']);
  await started(second);

  await until(async () => (await messagesOf(api.db)).every((message) => message.status === 'delivered'), 'every event delivered', 30_000);
  const messages = await messagesOf(api.db);
  t.same(messages.map((message) => message.request_id).sort(), [...ids].sort(), 'one message per request');
  const problems: string[] = [];
  for (const message of messages) {
    const tries = await triesOf(api.db, message.id);
    const outcomes = tries.map((row) => `${row.outcome}${row.error ? ` (${row.error})` : ''}`).join(', ');
    const expected = cut.has(message.id) ? 'failed (the worker stopped during the try), succeeded' : 'succeeded';
    if (outcomes !== expected) problems.push(`${message.id}: ${outcomes}`);
  }
  t.same(problems, [], 'each cut try recorded as failed, then a try that succeeded; each message that waited, one try that succeeded');
  const verified = receiver.deliveries.slice(10);
  t.equal(verified.length, 20, 'twenty deliveries after the restart');
  t.ok(verified.every((delivery) => delivery.verifiedWith.length === 1), 'all verified');
  t.same(new Set(verified.map((delivery) => String(delivery.headers['webhook-id']))), new Set(messages.map((message) => message.id)), 'one for each message, the cut ones with the same webhook-id');
});

t.test('a rotated secret: deliveries during the overlap verify with the old secret and with the new one', async (t) => {
  const gateway = await startTestGateway(t, { env: WEBHOOK_SETTINGS });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t);
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  const rotated = await rotateSecret(gateway.db, gateway.config.secretEncryptionKeys[0], endpoint.id);
  receiver.secrets = [endpoint.secret, rotated!.secret];
  const client = clientFor(gateway.url, key);
  for (let i = 0; i < 3; i++) await client.post({ model: i === 2 ? 'test-error-400' : 'test-echo', messages: userMessage() });
  await until(() => receiver.deliveries.length === 3, 'three deliveries', 10_000);
  t.same(receiver.deliveries.map((delivery) => delivery.verifiedWith), [[0, 1], [0, 1], [0, 1]], 'each verified by standardwebhooks with either secret');
});

t.test('without WEBHOOK_ALLOW_PRIVATE an endpoint named localhost is refused at delivery: the try fails, the receiver sees nothing', async (t) => {
  const gateway = await startTestGateway(t, { env: { WEBHOOK_RETRY_SCHEDULE: '60000' } });
  t.equal(gateway.config.webhooks.allowPrivate, false);
  const key = await gateway.createKey();
  const receiver = await startReceiver(t);
  // A name passes the check made when the endpoint is added; it resolves to 127.0.0.1 (or ::1).
  await addEndpoint(gateway.db, { encryptionKey: gateway.config.secretEncryptionKeys[0], allowPrivate: false }, {
    project: 'test-project',
    url: `https://localhost:${receiver.port}/hooks`,
  });
  await clientFor(gateway.url, key).post({ model: 'test-echo', messages: userMessage(), wait: true });
  await until(async () => (await messagesOf(gateway.db))[0]?.tries === 1 && (await messagesOf(gateway.db))[0]?.status === 'pending', 'the try ended', 10_000);
  const [message] = await messagesOf(gateway.db);
  t.match(await triesOf(gateway.db, message!.id), [
    { outcome: 'failed', http_status: null, error: /^the endpoint resolves to a private address \((127\.0\.0\.1|::1)\); WEBHOOK_ALLOW_PRIVATE is off$/ },
  ]);
  t.ok(message!.next_try_at, 'retried on the schedule like any failure');
  t.equal(receiver.connections, 0, 'the receiver saw nothing, not even a connection');
  const { rows } = await gateway.pool.query('select last_failure_error from gateway.failing_webhook_endpoints');
  t.match(rows, [{ last_failure_error: /private address/ }], 'the psql view says why');
});
