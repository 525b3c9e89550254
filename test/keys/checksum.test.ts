// Keys end with a checksum (src/ids.ts): a key the gateway cannot have issued is refused from its
// text alone, however many come; keys made before checksums keep working.
import t from 'tap';
import { createDb, createPool } from '../../src/db/pool.ts';
import { API_KEY, mayBeIssuedApiKey, newApiKey, randomBase62 } from '../../src/ids.ts';
import { hashApiKey } from '../../src/keys/secrets.ts';
import { authenticate } from '../../src/keys/service.ts';
import { createLogger } from '../../src/logger.ts';
import { inBatches } from '../helpers/concurrency.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { createKnownKey } from '../helpers/keys.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { until } from '../helpers/wait.ts';

t.test('a new key passes its own checksum, and a key with one character changed does not', async (t) => {
  for (const mode of ['live', 'test'] as const) {
    const key = newApiKey(mode);
    t.match(key, API_KEY);
    t.ok(mayBeIssuedApiKey(key), `${mode}: passes`);
    const typo = key.slice(0, 20) + (key[20] === 'a' ? 'b' : 'a') + key.slice(21);
    t.notOk(mayBeIssuedApiKey(typo), `${mode}: a typo fails`);
    t.notOk(mayBeIssuedApiKey(key.replace(`svc_${mode}_`, mode === 'live' ? 'svc_test_' : 'svc_live_')), `${mode}: so does its other mode`);
    t.notOk(mayBeIssuedApiKey(key.slice(0, -1)), `${mode}: and the key cut short`);
  }
});

t.test('2,000 made-up keys of the checksummed shape are refused 401 invalid_api_key without a database read, and counted', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { METRICS_PORT: '0' } });
  const issued = await gateway.createKey();
  const forged = Array.from({ length: 2_000 }, (_, i) => (i === 0 ? issued.api_key.slice(0, -1) + (issued.api_key.endsWith('a') ? 'b' : 'a') : `svc_test_${randomBase62(46)}`));

  // The service, on a pool of its own that counts the connections taken.
  const pool = createPool(gateway.databaseUrl, { max: 10, applicationName: 'forged-keys-test', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  let acquired = 0;
  pool.on('acquire', () => acquired++);
  const db = createDb(pool);
  let unknown = 0;
  const codes = await Promise.all(
    forged.map((key) =>
      authenticate(db, `Bearer ${key}`, { cache: gateway.keys, onUnknown: () => unknown++ }).then(
        () => 'accepted',
        (error: { code: string }) => error.code,
      ),
    ),
  );
  t.same(new Set(codes), new Set(['invalid_api_key']), 'all refused');
  t.equal(acquired, 0, 'no connection taken: no statement run');
  t.equal(unknown, 2_000, 'each one told as unknown');

  // Over HTTP, with api_keys locked against reads: a request that read it would wait for the lock.
  const locker = await gateway.pool.connect();
  t.teardown(() => locker.release());
  await locker.query('begin');
  await locker.query('lock table gateway.api_keys in access exclusive mode');
  const answers = await inBatches(forged, 50, (key) => send(gateway.url, { path: '/v1/requests/req_0', key }));
  t.same(new Set(answers.map((answer) => `${answer.status} ${answer.body.error.type} ${answer.body.error.code}`)), new Set(['401 authentication_error invalid_api_key']));
  await locker.query('rollback');
  const metrics = parseMetrics((await send(gateway.metricsUrl, { path: '/metrics' })).text);
  t.equal(metrics.get('gateway_unknown_keys_total'), 2_000, 'gateway_unknown_keys_total counts them');
});

t.test('a key made before checksums (40 characters, no checksum) still authenticates', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const old = await createKnownKey(gateway, `svc_test_${randomBase62(40)}`);
  // Read as any key once the API has heard of its creation (test/keys/unchecksummed.test.ts).
  await until(() => gateway.unchecksummed!.mayBeActive(hashApiKey(old.api_key)), 'the API to hear of the key without a checksum');
  t.equal((await clientFor(gateway.url, old).post({ model: 'm', messages: userMessage() })).status, 202);
});
