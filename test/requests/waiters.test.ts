// wait=true across processes and connections: completions reach waiters through NOTIFY, a
// waiter whose client hangs up is dropped, a shutdown answers every waiter at once, and a read
// that a silent database connection holds does not hold the waiter past its wait.
import http from 'node:http';
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { Listener } from '../../src/db/listener.ts';
import { createLogger } from '../../src/logger.ts';
import { Waiters } from '../../src/requests/waiters.ts';
import { createTestDatabase } from '../helpers/database.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { signature } from '../helpers/signing.ts';
import { startTcpProxy } from '../helpers/tcp-proxy.ts';
import { until } from '../helpers/wait.ts';

t.test('a waiter in an API process hears a completion made by a worker in another process', async (t) => {
  const api = await startTestGateway(t, { role: 'api', env: { WAIT_TIMEOUT_MS: '10000' } });
  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl });
  const answer = await clientFor(api.url, await api.createKey()).post({
    model: 'test-delay-200',
    messages: userMessage('across processes'),
    wait: true,
  });
  t.equal(answer.status, 200);
  t.equal(answer.body.choices[0].message.content, 'across processes');
});

t.test('a waiter whose client disconnects is dropped', async (t) => {
  const gateway = await startTestGateway(t, { env: { WAIT_TIMEOUT_MS: '20000', UPSTREAM_TIMEOUT_MS: '10000' } });
  const key = await gateway.createKey();
  const body = JSON.stringify({ model: 'test-delay-5000', messages: userMessage(), wait: true });
  const request = http.request(`${gateway.url}/v1/chat/completions`, {
    method: 'POST',
    headers: {
      authorization: `Bearer ${key.api_key}`,
      'content-type': 'application/json',
      'svc-signature': signature({ secret: key.signing_secret, method: 'POST', path: '/v1/chat/completions', body }),
    },
  });
  request.on('error', () => {});
  request.end(body);
  for (let i = 0; gateway.waiters!.size === 0; i++) {
    if (i > 200) throw new Error('the request never started waiting');
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  t.equal(gateway.waiters!.size, 1, 'waiting');
  request.destroy();
  for (let i = 0; gateway.waiters!.size > 0; i++) {
    if (i > 200) break;
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  t.equal(gateway.waiters!.size, 0, 'dropped once the client is gone');
  const { rows } = await gateway.pool.query('select count(*)::int as count from gateway.requests');
  t.equal(rows[0].count, 1, 'the request itself stays');
});

t.test('shutting down answers waiting requests with their acknowledgement', async (t) => {
  const gateway = await startTestGateway(t, { env: { WAIT_TIMEOUT_MS: '30000', UPSTREAM_TIMEOUT_MS: '60000' } });
  const client = clientFor(gateway.url, await gateway.createKey());
  const pending = client.post({ model: 'test-delay-60000', messages: userMessage(), wait: true });
  for (let i = 0; ; i++) {
    const { rows } = await gateway.pool.query(`select 1 from gateway.requests where status = 'processing'`);
    if (rows.length > 0 && gateway.waiters!.size === 1) break;
    if (i > 500) throw new Error('the request never got under way');
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  const stopped = gateway.stop();
  const answer = await pending;
  t.equal(answer.status, 202);
  t.equal(answer.body.object, 'chat.completion.async');
  t.equal(answer.body.status, 'processing');
  await stopped;
});

t.test('a waiter in the process of the worker that completed its request is handed the committed result', async (t) => {
  const gateway = await startTestGateway(t, { env: { WAIT_TIMEOUT_MS: '10000' } });
  const waiters = gateway.waiters!;
  const handed = new Map<string, string | undefined>();
  const recorded = waiters.recorded.bind(waiters);
  waiters.recorded = (id, outcome) => {
    handed.set(id, outcome.result);
    recorded(id, outcome);
  };
  const answer = await clientFor(gateway.url, await gateway.createKey()).post({
    model: 'test-delay-50',
    messages: userMessage('in one process'),
    wait: true,
  });
  t.equal(answer.status, 200);
  t.equal(answer.body.choices[0].message.content, 'in one process');
  const { rows } = await gateway.pool.query(`select id, result::text as result from gateway.requests`);
  t.same([...handed], [[rows[0].id, rows[0].result]], 'its result was handed over, as committed');
  t.equal(answer.text, rows[0].result, 'and is the answer');
});

/** Waiters of no database: told of outcomes only by the test (their listener never connects). */
function waitersAlone(): Waiters {
  return new Waiters(new Listener('postgres://127.0.0.1:9/none', createLogger({ logLevel: 'silent' })));
}

t.test('a completion handed over before or during the wait ends it with the result', async (t) => {
  const waiters = waitersAlone();
  const early = waiters.watch('req_early');
  waiters.recorded('req_early', { result: '{"early":true}', ended: true });
  t.equal(await early.next(1_000), 'completed', 'handed over before the wait began');
  t.equal(early.result, '{"early":true}');
  early.close();

  const during = waiters.watch('req_during');
  const event = during.next(1_000);
  waiters.recorded('req_during', { result: '{"during":true}', ended: true });
  t.equal(await event, 'completed', 'handed over while waiting');
  t.equal(during.result, '{"during":true}');
  during.close();
  t.equal(waiters.size, 0);
});

t.test('a waiter reading its row hears of a result handed over meanwhile, or already', async (t) => {
  const waiters = waitersAlone();
  const watch = waiters.watch('req_racing');
  waiters.wake(['req_racing']); // its NOTIFY, first
  t.equal(await watch.next(1_000), 'changed', 'woken to read its row');
  let handed = false;
  const handedOver = watch.handedOver().then(() => (handed = true));
  await new Promise((resolve) => setImmediate(resolve));
  t.notOk(handed, 'nothing handed over yet');
  waiters.recorded('req_racing', { result: '{"raced":true}', ended: true });
  await handedOver;
  t.equal(watch.result, '{"raced":true}', 'then the result, while the read is under way');
  const again = await Promise.race([
    watch.handedOver().then(() => 'resolved'),
    new Promise((resolve) => setImmediate(() => resolve('still pending'))),
  ]);
  t.equal(again, 'resolved', 'and, asked again, at once');
  watch.close();
});

t.test('a wake-up for a request whose outcome this process is recording waits for the recording, which answers it', async (t) => {
  const waiters = waitersAlone();
  const soon = <T>(event: Promise<T>) => Promise.race([event, new Promise((resolve) => setImmediate(() => resolve('still waiting')))]);

  const completed = waiters.watch('req_completed');
  const completion = completed.next(1_000);
  waiters.recording('req_completed');
  waiters.wake(['req_completed']); // its NOTIFY, before the recording's own answer
  t.equal(await soon(completion), 'still waiting', 'not woken to read its row while the recording is under way');
  waiters.recorded('req_completed', { result: '{"done":true}', ended: true });
  t.equal(await completion, 'completed', 'answered by the recording');
  t.equal(completed.result, '{"done":true}');
  completed.close();

  const failed = waiters.watch('req_failed');
  const failure = failed.next(1_000);
  waiters.recording('req_failed');
  waiters.wake(['req_failed']);
  t.equal(await soon(failure), 'still waiting');
  waiters.recorded('req_failed', { ended: true });
  t.equal(await failure, 'changed', 'a request that failed: its waiter reads its row');
  failed.close();

  const retried = waiters.watch('req_retried');
  const retry = retried.next(1_000);
  waiters.recording('req_retried');
  waiters.recorded('req_retried', { ended: false });
  t.equal(await soon(retry), 'still waiting', 'a request retried, with no wake-up meanwhile: nothing to read');
  waiters.recording('req_retried');
  waiters.wake(['req_retried']); // a cancel committed while its outcome was being recorded
  t.equal(await soon(retry), 'still waiting');
  waiters.recorded('req_retried', { ended: false });
  t.equal(await retry, 'changed', 'a wake-up that came meanwhile is passed on when the recording ends');
  retried.close();

  const other = waiters.watch('req_other');
  waiters.recording('req_retried'); // no longer watched: nothing is held for it
  waiters.wake(['req_other', 'req_retried']);
  t.equal(await other.next(1_000), 'changed', "another request's wake-up is not held");
  other.close();
  t.equal(waiters.size, 0);
});

t.test('a waiter whose reads meet a silent database connection is answered at WAIT_TIMEOUT_MS, with what is known', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  const proxy = await startTcpProxy(t, databaseUrl);
  // No worker: the request is still queued when its wait ends.
  const api = await startTestGateway(t, { role: 'api', databaseUrl: proxy.url, env: { WAIT_TIMEOUT_MS: '2000' } });
  const client = clientFor(api.url, await api.createKey());
  const waiting = client.post({ model: 'test-echo', messages: userMessage(), wait: true });
  // The request stored (it waits now), its process's pooled connections go silent: the read at
  // the wait's end gets no answer.
  await until(async () => (await api.pool.query(`select count(*)::int as n from gateway.requests`)).rows[0].n === 1, 'the request to be stored');
  t.ok(proxy.blackHole('gateway-api') >= 1, 'the API pool\'s connections silenced');
  // The connections stay silent for good: held by the read, the waiter would get no answer at
  // all; 10 s (five times the wait) is how long the test waits for one.
  const answer = await Promise.race([waiting, sleep(10_000).then(() => undefined)]);
  t.equal(answer?.status, 202, 'the acknowledgement, at the wait\'s end, not held by the read');
  t.equal(answer?.body.status, 'queued', 'with the status last known');
  proxy.cut();
  await waiting.catch(() => {});
});
