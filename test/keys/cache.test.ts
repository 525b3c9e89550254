// The key cache and the LISTEN connection it and the waiters share: revocations reach every
// API process, nothing is served from the cache while notifications could be missed, a lost
// LISTEN connection costs no waiter its answer, and concurrent misses share one read.
import t from 'tap';
import { createDb, createPool } from '../../src/db/pool.ts';
import { authenticate } from '../../src/keys/service.ts';
import { hashApiKey } from '../../src/keys/secrets.ts';
import { createLogger } from '../../src/logger.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { until } from '../helpers/wait.ts';

async function killListener(gateway: TestGateway) {
  const { rows } = await gateway.pool.query(
    `select pg_terminate_backend(pid) as killed from pg_stat_activity
     where application_name = 'gateway-listen' and datname = current_database()`,
  );
  return rows.length;
}

t.test('a revocation in one API process reaches the cache of another', async (t) => {
  const first = await startTestGateway(t, { role: 'api' });
  const second = await startTestGateway(t, { role: 'api', databaseUrl: first.databaseUrl });
  const key = await first.createKey();
  t.equal((await clientFor(second.url, key).post({ model: 'm', messages: userMessage() })).status, 202);
  t.equal(second.keys!.size, 1);

  await first.pool.query('update gateway.api_keys set revoked_at = now() where id = $1', [key.id]);
  await until(() => second.keys!.size === 0, 'the second process forgets the key');
  const refused = await clientFor(second.url, key).post({ model: 'm', messages: userMessage() });
  t.equal(refused.status, 401);
});

t.test('a key read before an invalidation is not cached after it', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const cache = gateway.keys!;
  const sha = hashApiKey(key.api_key);
  const auth = await authenticate(gateway.db, `Bearer ${key.api_key}`); // read without the cache
  let finishRead!: () => void;
  const reading = cache.read(sha, () => new Promise((resolve) => (finishRead = () => resolve(auth))));
  cache.forget('key_someotherkey00000000');
  finishRead();
  t.equal((await reading)?.keyId, key.id);
  t.equal(cache.size, 0, 'the stale read is not kept');
  await cache.read(sha, async () => auth);
  t.equal(cache.size, 1);
});

t.test('losing the LISTEN connection empties the cache; caching comes back with the connection', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const client = clientFor(gateway.url, key);
  t.equal((await client.post({ model: 'm', messages: userMessage() })).status, 202);
  t.equal(gateway.keys!.size, 1);

  t.equal(await killListener(gateway), 1);
  await until(() => gateway.keys!.size === 0, 'the cache is emptied when the connection is lost');
  await until(() => gateway.logs.some((line) => line.includes('LISTEN connection restored')), 'reconnection');
  t.equal((await client.post({ model: 'm', messages: userMessage() })).status, 202);
  t.equal(gateway.keys!.size, 1, 'caching again once notifications flow');
});

t.test('a waiter gets its answer although the LISTEN connection died during its wait', async (t) => {
  const api = await startTestGateway(t, { role: 'api', env: { WAIT_TIMEOUT_MS: '10000' } });
  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl });
  const pending = clientFor(api.url, await api.createKey()).post({
    model: 'test-delay-500',
    messages: userMessage('despite it all'),
    wait: true,
  });
  await until(() => api.waiters!.size === 1, 'waiting');
  t.equal(await killListener(api), 2, 'the API\'s LISTEN connection is killed (and the worker\'s)');
  const answer = await pending;
  t.equal(answer.status, 200);
  t.equal(answer.body.choices[0].message.content, 'despite it all');
});

t.test('requests that miss the same key at once share one read of it', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const cache = gateway.keys!;
  // A pool of its own, to count the connections the reads take.
  const pool = createPool(gateway.databaseUrl, { max: 10, applicationName: 'key-reads-test', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  let acquired = 0;
  pool.on('acquire', () => acquired++);
  const db = createDb(pool);

  const auths = await Promise.all(Array.from({ length: 20 }, () => authenticate(db, `Bearer ${key.api_key}`, cache)));
  t.equal(acquired, 1, 'one read for 20 requests');
  t.ok(auths.every((auth) => auth === auths[0] && auth.keyId === key.id), 'all got the key');
  t.equal(cache.size, 1);

  await authenticate(db, `Bearer ${key.api_key}`, cache);
  t.equal(acquired, 1, 'then it is served from the cache');

  cache.clear();
  const refused = Array.from({ length: 5 }, () => authenticate(db, `Bearer svc_test_${'0'.repeat(32)}`, cache));
  for (const attempt of refused) await t.rejects(attempt, { code: 'invalid_api_key' });
  t.equal(acquired, 2, 'an unknown key is read once for the 5 requests too, and not cached');
  t.equal(cache.size, 0);
});

t.test('a miss after an invalidation does not join a read begun before it', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const cache = gateway.keys!;
  const sha = hashApiKey(`svc_test_${'a'.repeat(32)}`);
  const auth = (keyId: string) => ({ keyId, projectId: '1', mode: 'test' as const, signingSecretCiphertext: Buffer.alloc(1) });
  let finishFirst!: () => void;
  let reads = 0;
  const first = cache.read(sha, async () => {
    reads++;
    await new Promise<void>((resolve) => (finishFirst = resolve));
    return auth('key_readBeforeTheRevocation1');
  });
  const sharing = cache.read(sha, async () => {
    reads++;
    return undefined;
  });
  t.equal(reads, 1, 'a miss during the read shares it');

  cache.forget('key_readBeforeTheRevocation1');
  const after = cache.read(sha, async () => {
    reads++;
    return undefined;
  });
  t.equal(reads, 2, 'a miss after the invalidation reads again');
  finishFirst();
  t.equal((await first)?.keyId, 'key_readBeforeTheRevocation1');
  t.equal((await sharing)?.keyId, 'key_readBeforeTheRevocation1');
  t.equal(await after, undefined, 'it sees the key as it is now');
  t.equal(cache.size, 0, 'the read begun before the invalidation is not cached');
});
