// Graceful shutdown: running attempts finish within SHUTDOWN_GRACE_MS, the rest are
// handed back to be retried; the process exits 0. And requests too broken for the app still
// get the contract's error shape.
import { randomBytes } from 'node:crypto';
import { connect } from 'node:net';
import t from 'tap';
import { startTestGateway } from './helpers/gateway.ts';
import { clientFor, userMessage } from './helpers/http.ts';
import { attemptRows, dispatchJobs, isTerminal, queueOf, requestRow, waitForRow } from './helpers/rows.ts';
import { spawnServe } from './helpers/serve.ts';
import { until } from './helpers/wait.ts';

t.test('a stopping worker lets short attempts finish and hands the long ones back', async (t) => {
  const gateway = await startTestGateway(t, { env: { SHUTDOWN_GRACE_MS: '1000', UPSTREAM_TIMEOUT_MS: '30000' } });
  const client = clientFor(gateway.url, await gateway.createKey());
  const short = (await client.post({ model: 'test-delay-300', messages: userMessage() })).body.id;
  const long = (await client.post({ model: 'test-delay-30000', messages: userMessage() })).body.id;
  for (const id of [short, long]) await waitForRow(gateway.db, id, (row) => row.status === 'processing');

  await gateway.stop();

  t.match(await requestRow(gateway.db, short), { status: 'completed', attempts: 1 }, 'finished within the grace period');
  t.match(await requestRow(gateway.db, long), { status: 'retrying', attempts: 1, last_error_code: 'worker_lost' });
  t.match(await attemptRows(gateway.db, long), [{ outcome: 'failed', error_code: 'worker_lost' }]);
  const queue = await queueOf(gateway.db, long);
  t.ok((await dispatchJobs(gateway.db)).some((job) => job.queue_id === queue), 'its queue is to be dispatched again');
  const { rows } = await gateway.pool.query('select count(*)::int as count from gateway.worker_pools');
  t.equal(rows[0].count, 0, 'the pool removed its heartbeat');
  const locked = await gateway.pool.query('select count(*)::int as count from graphile_worker.jobs where locked_by is not null');
  t.equal(locked.rows[0].count, 0, 'and left no job locked');

  // Another worker picks it up (made quick first: a worker that took it before the change
  // would run the 30 s model again).
  await gateway.pool.query(`update gateway.requests set model = 'test-echo', body = jsonb_set(body::jsonb, '{model}', '"test-echo"')::json where id = $1`, [long]);
  await startTestGateway(t, { role: 'worker', databaseUrl: gateway.databaseUrl });
  t.match(await waitForRow(gateway.db, long, isTerminal), { status: 'completed', attempts: 2 });
});

t.test('gateway serve exits 0 on SIGTERM', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const serve = spawnServe(t, {
    DATABASE_URL: gateway.databaseUrl,
    SECRET_ENCRYPTION_KEY: randomBytes(32).toString('base64'),
    PORT: '0',
    HOST: '127.0.0.1',
    LOG_LEVEL: 'info',
  });
  // (A start takes a second here, and several when the machine is busy: the test is of the exit.)
  await until(() => serve.output().includes('gateway started'), () => `gateway serve to start: ${serve.output()}`, 30_000);
  t.equal((await serve.kill('SIGTERM'))?.code, 0);
  t.match(serve.output(), /shut down cleanly/);
});

t.test('unparseable requests and oversized headers get the contract error shape', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const { port } = new URL(gateway.url);
  const raw = (text: string) =>
    new Promise<string>((resolve, reject) => {
      const socket = connect(Number(port), '127.0.0.1', () => socket.end(text));
      let answer = '';
      socket.on('data', (chunk) => (answer += chunk));
      socket.on('end', () => resolve(answer));
      socket.on('error', reject);
    });

  const garbage = await raw('THIS IS NOT HTTP\r\n\r\n');
  t.match(garbage, /^HTTP\/1\.1 400 /);
  t.same(JSON.parse(garbage.slice(garbage.indexOf('\r\n\r\n') + 4)).error, {
    message: 'The request is not valid HTTP/1.1.',
    type: 'invalid_request_error',
    code: 'invalid_body',
    param: null,
  });

  const huge = await raw(`GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ${'a'.repeat(20_000)}\r\n\r\n`);
  t.match(huge, /^HTTP\/1\.1 413 /);
  t.equal(JSON.parse(huge.slice(huge.indexOf('\r\n\r\n') + 4)).error.code, 'request_too_large');

  const manyHeaders = await raw(
    `GET /healthz HTTP/1.1\r\nHost: x\r\n${Array.from({ length: 150 }, (_, i) => `X-H${i}: v`).join('\r\n')}\r\n\r\n`,
  );
  t.match(manyHeaders, /^HTTP\/1\.1 413 /, 'more headers than maxHeadersCount is too large too');
  t.equal(JSON.parse(manyHeaders.slice(manyHeaders.indexOf('\r\n\r\n') + 4)).error.code, 'request_too_large');
});
