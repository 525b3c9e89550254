// Reads of keys the cache does not hold are bounded per API process (src/keys/reads.ts): a
// flood of unknown keys holds a few of the pool's connections, is refused 503 beyond its line,
// and delays no request whose key the cache holds. The flood's keys are made up with a checksum
// that matches (anyone can compute one): each must be read.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { newApiKey } from '../../src/ids.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage, type Answer } from '../helpers/http.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { until, waitFor } from '../helpers/wait.ts';

t.test('a flood of 200 unknown keys holds 4 connections, 64 more wait, the rest are refused 503; a cached key is served meanwhile', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { METRICS_PORT: '0' } });
  const key = await gateway.createKey();
  const client = clientFor(gateway.url, key);
  const accepted = await client.post({ model: 'm', messages: userMessage() });
  t.equal(accepted.status, 202, 'the key is in the cache now');

  // api_keys locked against reads: every read of a key waits for the lock, holding its connection.
  const locker = await gateway.pool.connect();
  t.teardown(() => locker.release());
  await locker.query('begin');
  await locker.query('lock table gateway.api_keys in access exclusive mode');
  const readsWaitingOnTheLock = async () => {
    const { rows } = await gateway.pool.query<{ count: string }>(
      `select count(*) from pg_stat_activity
       where datname = current_database() and application_name = 'gateway-api' and wait_event_type = 'Lock'`,
    );
    return Number(rows[0]!.count);
  };

  const answers: Answer[] = [];
  const flood = Array.from({ length: 200 }, () =>
    send(gateway.url, { path: '/v1/requests/req_0', key: newApiKey('test') }).then((answer) => answers.push(answer)),
  );
  await until(async () => (await readsWaitingOnTheLock()) >= 4, 'the flood to reach the database');
  await sleep(300);
  t.equal(await readsWaitingOnTheLock(), 4, 'reads under way: 4 of the pool\'s 10 connections');
  await waitFor(() => answers.length >= 132, 5_000);
  t.equal(answers.length, 132, 'beyond the 64 waiting, answered without waiting');
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
  const refused = answers.slice(132);
  t.equal(refused.length, 68);
  t.ok(refused.every((answer) => answer.status === 401 && answer.body.error.code === 'invalid_api_key'), 'the reads and the line: 401 once the lock is gone');
  const metrics = parseMetrics((await send(gateway.metricsUrl, { path: '/metrics' })).text);
  t.equal(metrics.get('gateway_key_reads_refused_total'), 132);
  t.equal(metrics.get('gateway_unknown_keys_total'), 68);
});
