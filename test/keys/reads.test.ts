// Reads of keys the cache does not hold are grouped and bounded per API process
// (src/keys/reads.ts): a flood of unknown keys holds a few of the pool's connections, costs a
// statement per group of keys, is refused 503 beyond its line, and delays no request whose key the
// cache holds. The flood's keys are made up with a checksum that matches (anyone can compute
// one): each must be read.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { createDb, createPool } from '../../src/db/pool.ts';
import { newApiKey } from '../../src/ids.ts';
import { KeyReads } from '../../src/keys/reads.ts';
import { hashApiKey } from '../../src/keys/secrets.ts';
import { createLogger } from '../../src/logger.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage, type Answer } from '../helpers/http.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { apiWaitingOnLock } from '../helpers/rows.ts';
import { until, waitFor } from '../helpers/wait.ts';

t.test('a flood of 400 unknown keys holds 2 connections, 256 more keys wait, the rest are refused 503; a cached key is served meanwhile', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { METRICS_PORT: '0' } });
  const key = await gateway.createKey();
  const client = clientFor(gateway.url, key);
  const accepted = await client.post({ model: 'm', messages: userMessage() });
  t.equal(accepted.status, 202, 'the key is in the cache now');

  // api_keys locked against reads: every read of keys waits for the lock, holding its connection.
  const locker = await gateway.pool.connect();
  t.teardown(() => locker.release());
  await locker.query('begin');
  await locker.query('lock table gateway.api_keys in access exclusive mode');
  const readsWaitingOnTheLock = () => apiWaitingOnLock(gateway.pool);

  const answers: Answer[] = [];
  const flood = Array.from({ length: 400 }, () =>
    send(gateway.url, { path: '/v1/requests/req_0', key: newApiKey('test') }).then((answer) => answers.push(answer)),
  );
  await until(async () => (await readsWaitingOnTheLock()) >= 2, 'the flood to reach the database');
  await sleep(300);
  t.equal(await readsWaitingOnTheLock(), 2, 'reads under way: 2 of the pool\'s 10 connections');
  await waitFor(() => answers.length >= 142, 5_000);
  t.equal(answers.length, 142, 'beyond the 2 keys being read and the 256 waiting, answered without waiting');
  t.same(
    new Set(answers.map((answer) => `${answer.status} ${answer.body.error.type} ${answer.body.error.code} retry-after ${answer.headers.get('retry-after')}`)),
    new Set(['503 api_error service_unavailable retry-after 1']),
  );

  const started = performance.now();
  const lookup = await client.get(accepted.body.id);
  t.equal(lookup.status, 200, 'a request with a cached key is served during the flood');
  t.comment(`in ${Math.round(performance.now() - started)} ms`);

  await locker.query('rollback');
  await Promise.all(flood);
  const refused = answers.slice(142);
  t.equal(refused.length, 258);
  t.ok(refused.every((answer) => answer.status === 401 && answer.body.error.code === 'invalid_api_key'), 'the reads and the line: 401 once the lock is gone');
  const metrics = parseMetrics((await send(gateway.metricsUrl, { path: '/metrics' })).text);
  t.equal(metrics.get('gateway_key_reads_refused_total'), 142);
  t.equal(metrics.get('gateway_unknown_keys_total'), 258);
});

t.test('keys asked for while a read is under way share the next statement: 102 keys in 4 statements, each key its own answer', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const first = await gateway.createKey();
  const second = await gateway.createKey({ mode: 'live' });
  const pool = createPool(gateway.databaseUrl, { max: 10, applicationName: 'key-reads-test', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  let statements = 0;
  pool.on('acquire', () => statements++);
  const reads = new KeyReads(createDb(pool));

  // Two keys of the gateway among 100 made up: the first two asked go out alone, one statement
  // each (2 under way at most); the other 100 wait and share the next two (64 keys at most each).
  const keys = Array.from({ length: 100 }, () => newApiKey('test'));
  keys.splice(50, 0, first.api_key);
  keys.push(second.api_key);
  const found = await Promise.all(keys.map((apiKey) => reads.read(hashApiKey(apiKey))));
  t.equal(statements, 4, '4 statements');
  t.same(
    found.flatMap((key, index) => (key ? [{ index, id: key.id, mode: key.mode }] : [])),
    [
      { index: 50, id: first.id, mode: 'test' },
      { index: 101, id: second.id, mode: 'live' },
    ],
    'the two keys found, each where it was asked for; the others not',
  );
});
