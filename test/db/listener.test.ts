// The LISTEN connection (db/listener.ts) when it dies without a word: a proxy between the
// gateway and Postgres stops forwarding its bytes and keeps its sockets open, as a NAT or load
// balancer that forgets an idle flow does. The connection is found dead by its round trips
// within 10 s, its subscribers are told, and it is replaced; meanwhile waiters and the dispatcher
// fall back to reading the database, long before WAIT_TIMEOUT_MS or an upstream timeout.
import t from 'tap';
import pg from 'pg';
import { Listener } from '../../src/db/listener.ts';
import { createLogger } from '../../src/logger.ts';
import { createTestDatabase } from '../helpers/database.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage, type Answer } from '../helpers/http.ts';
import { startTcpProxy } from '../helpers/tcp-proxy.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';

// The listener finds a dead connection within 8 s; the rest is room for a loaded machine.
const FOUND_WITHIN_MS = 15_000;

const logged = (logs: string[], message: string) => logs.some((line) => line.includes(message));

t.test('a LISTEN connection gone silent is found dead by its round trips, reported lost, and replaced by one that hears notifications', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  const proxy = await startTcpProxy(t, databaseUrl);
  const logs: string[] = [];
  const logger = createLogger({ logLevel: 'info' }, { write: (line: string) => void logs.push(line) });
  const listener = new Listener(proxy.url, logger);
  const events: { event: string; at: number; payload?: string }[] = [];
  listener.subscribe('listener_test', {
    notification: (payload) => events.push({ event: 'notification', at: Date.now(), payload }),
    lost: () => events.push({ event: 'lost', at: Date.now() }),
    restored: () => events.push({ event: 'restored', at: Date.now() }),
  });
  await listener.start();
  t.teardown(() => listener.close());
  const notifier = new pg.Client({ connectionString: databaseUrl });
  await notifier.connect();
  t.teardown(() => notifier.end());
  const notify = (payload: string) => notifier.query(`select pg_notify('listener_test', $1)`, [payload]);

  await notify('before');
  await until(() => events.some((event) => event.payload === 'before'), 'the first notification');

  t.equal(proxy.blackHole('gateway-listen'), 1, 'its connection goes silent, both ways, its sockets open');
  const silentAt = Date.now();
  await notify('into the void');
  await until(() => events.some((event) => event.event === 'lost'), 'the loss to be reported', FOUND_WITHIN_MS);
  t.comment(`found dead ${events.find((event) => event.event === 'lost')!.at - silentAt} ms after it went silent`);
  t.notOk(listener.listening, 'and not listening meanwhile');
  // By its round trips (one every 5 s, answered within 3 s: found within 8 s), not by the
  // kernel's keepalive, which gives up on a silent socket far later.
  t.ok(logged(logs, 'LISTEN connection found dead: a round trip went unanswered'), 'the log says it was found dead, by a round trip unanswered');

  await until(() => events.some((event) => event.event === 'restored'), 'the connection to be restored');
  t.ok(listener.listening, 'listening again');
  t.ok(logged(logs, 'LISTEN connection restored'), 'the log says it was restored');
  await until(
    () => proxy.open().filter((name) => name === 'gateway-listen').length === 1,
    'the silent connection to be closed by the listener, and one LISTEN connection left open',
  );
  await notify('after');
  await until(() => events.some((event) => event.payload === 'after'), 'a notification on the new connection');
  t.same(
    events.map((event) => event.payload ?? event.event),
    ['before', 'lost', 'restored', 'after'],
    'what was sent into the silent connection was missed, as subscribers are told',
  );
});

t.test('a listener whose connection has gone silent closes at once, as a shutdown needs', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  const proxy = await startTcpProxy(t, databaseUrl);
  const logger = createLogger({ logLevel: 'info' }, { write: () => {} });
  const listener = new Listener(proxy.url, logger);
  listener.subscribe('listener_test', { notification: () => {} });
  await listener.start();
  t.equal(proxy.blackHole('gateway-listen'), 1, 'its connection goes silent, both ways, its sockets open');
  const closing = listener.close().then(() => 'closed' as const);
  const outcome = await Promise.race([closing, new Promise<'still closing'>((resolve) => setTimeout(() => resolve('still closing'), 2_000))]);
  t.equal(outcome, 'closed', 'closed within 2 s, though Postgres never answers its goodbye');
  await until(() => proxy.open().every((name) => name !== 'gateway-listen'), 'its socket to be closed');
});

t.test('a pause of this process longer than a round trip\'s timeout, its answer already in, is no dead connection', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  const proxy = await startTcpProxy(t, databaseUrl);
  const logs: string[] = [];
  const listener = new Listener(proxy.url, createLogger({ logLevel: 'info' }, { write: (line: string) => void logs.push(line) }));
  const events: string[] = [];
  listener.subscribe('listener_test', {
    notification: () => events.push('notification'),
    lost: () => events.push('lost'),
    restored: () => events.push('restored'),
  });
  await listener.start();
  t.teardown(() => listener.close());

  // Nothing is notified, so the next answer on the connection is its next round trip's. Once it
  // has reached the socket, and before the listener reads it, this process stalls for 4 s (a
  // long GC pause): the round trip's 3 s are over when the listener next looks.
  let pausedMs = 0;
  proxy.afterNextReply('gateway-listen', () => {
    const from = Date.now();
    while (Date.now() - from < 4_000);
    pausedMs = Date.now() - from;
  });
  await until(() => pausedMs > 0, 'a round trip, and the pause', 10_000);
  await new Promise((resolve) => setTimeout(resolve, 1_000));
  t.same(events, [], 'the connection is not taken for lost');
  t.ok(listener.listening, 'it is still listening');
  t.notOk(logged(logs, 'LISTEN connection found dead'), 'nor said to be dead');
});

t.test('a wait=true request completed by another process while the API\'s LISTEN connection is silent is answered within 15 s, not after WAIT_TIMEOUT_MS', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  const proxy = await startTcpProxy(t, databaseUrl);
  // Only the API goes through the proxy; the worker, another gateway, talks to Postgres directly.
  const api = await startTestGateway(t, { role: 'api', databaseUrl: proxy.url, env: { WAIT_TIMEOUT_MS: '60000' } });
  await startTestGateway(t, { role: 'worker', databaseUrl });
  const client = clientFor(api.url, await api.createKey());
  t.equal((await client.post({ model: 'test-echo', messages: userMessage('warm-up'), wait: true })).status, 200, 'answered while the connection works');

  t.equal(proxy.blackHole('gateway-listen'), 1, 'the API\'s LISTEN connection goes silent');
  const sentAt = Date.now();
  let answer: Answer | undefined;
  const pending = client.post({ model: 'test-delay-300', messages: userMessage('through the silence'), wait: true }).then((received) => (answer = received));
  await until(() => answer !== undefined, 'the answer', FOUND_WITHIN_MS);
  await pending;
  const answeredAfterMs = Date.now() - sentAt;
  t.equal(answer!.status, 200, 'the completion, not the acknowledgement');
  t.equal(answer!.body.choices[0].message.content, 'through the silence', 'its own');
  t.comment(`answered ${answeredAfterMs} ms after it was sent (WAIT_TIMEOUT_MS is 60000)`);
  t.ok(logged(api.logs, 'LISTEN connection found dead'), 'the log says the connection was found dead');
  await until(() => logged(api.logs, 'LISTEN connection restored'), 'the log to say it was restored');
});

t.test('a processing request cancelled while its worker\'s LISTEN connection is silent has its upstream call aborted within 15 s', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  const proxy = await startTcpProxy(t, databaseUrl);
  const upstream = await startFakeUpstream(t, () => ({ hang: true }));
  const env = { UPSTREAM_BASE_URL: upstream.baseUrl, UPSTREAM_TIMEOUT_MS: '60000' };
  const api = await startTestGateway(t, { role: 'api', databaseUrl, env });
  const worker = await startTestGateway(t, { role: 'worker', databaseUrl: proxy.url, env });
  const key = await api.createKey({ mode: 'live' });
  const accepted = await clientFor(api.url, key).post({ model: 'gpt-x', messages: userMessage() });
  await until(() => upstream.calls.length === 1, 'the call to reach the upstream');
  const call = upstream.calls[0]!;

  t.equal(proxy.blackHole('gateway-listen'), 1, 'the worker\'s LISTEN connection goes silent');
  const cancelledAt = Date.now();
  const cancelled = await send(api.url, { method: 'POST', path: `/v1/requests/${accepted.body.id}/cancel`, key });
  t.equal(cancelled.status, 200, 'cancelled');
  await until(() => call.endedAt !== undefined, 'the worker to abort the upstream call', FOUND_WITHIN_MS);
  t.comment(`the upstream saw its connection closed ${call.endedAt! - cancelledAt} ms after the cancel (UPSTREAM_TIMEOUT_MS is 60000)`);
  t.ok(logged(worker.logs, 'LISTEN connection found dead'), 'the worker\'s log says its connection was found dead');
  t.equal(upstream.calls.length, 1, 'and the request is not attempted again');
});
