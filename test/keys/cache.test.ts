// The key cache and the LISTEN connection it and the waiters share: revocations reach every
// API process, nothing is served from the cache while notifications could be missed (even when
// the connection dies without a word), a lost LISTEN connection costs no waiter its answer, and
// concurrent misses share one read.
import t from 'tap';
import { createDb, createPool } from '../../src/db/pool.ts';
import { KeyCache } from '../../src/keys/cache.ts';
import { KeyReads } from '../../src/keys/reads.ts';
import { revokeKey } from '../../src/keys/repository.ts';
import { authenticate } from '../../src/keys/service.ts';
import { hashApiKey } from '../../src/keys/secrets.ts';
import { createLogger } from '../../src/logger.ts';
import { createTestDatabase } from '../helpers/database.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { createKnownKey } from '../helpers/keys.ts';
import { startTcpProxy } from '../helpers/tcp-proxy.ts';
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

t.test('a key revoked while the API\'s LISTEN connection is silent stops authenticating within 15 s, not after the cache\'s minute', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  // The API reaches Postgres through a proxy that can silence its LISTEN connection (as a NAT
  // that forgets the flow does); the revocation comes from another process, directly.
  const proxy = await startTcpProxy(t, databaseUrl);
  const api = await startTestGateway(t, { role: 'api', databaseUrl: proxy.url });
  const admin = await startTestGateway(t, { role: 'api', databaseUrl });
  const key = await api.createKey();
  const client = clientFor(api.url, key);
  // The key's creation is announced too, and forgets it if it comes after the first request.
  await until(
    async () => (await client.post({ model: 'm', messages: userMessage() })).status === 202 && api.keys!.size === 1,
    'the key to be cached',
  );

  t.equal(proxy.blackHole('gateway-listen'), 1, 'the API\'s LISTEN connection goes silent');
  const revokedAt = Date.now();
  t.ok(await revokeKey(admin.db, key.id), 'revoked');
  let status = 0;
  await until(
    async () => (status = (await client.post({ model: 'm', messages: userMessage() })).status) === 401,
    () => `the revoked key to be refused (last answer ${status})`,
    15_000,
  );
  t.comment(`refused ${Date.now() - revokedAt} ms after the revocation (the cache keeps a key for 60 s)`);
  t.ok(api.logs.some((line) => line.includes('LISTEN connection found dead')), 'the log says the connection was found dead');
  await until(() => api.logs.some((line) => line.includes('LISTEN connection restored')), 'the log to say it was restored');
  t.equal((await client.post({ model: 'm', messages: userMessage() })).status, 401, 'and refused after it is restored');
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

  const auths = await Promise.all(Array.from({ length: 20 }, () => authenticate(db, `Bearer ${key.api_key}`, { cache })));
  t.equal(acquired, 1, 'one read for 20 requests');
  t.ok(auths.every((auth) => auth === auths[0] && auth.keyId === key.id), 'all got the key');
  t.equal(cache.size, 1);

  await authenticate(db, `Bearer ${key.api_key}`, { cache });
  t.equal(acquired, 1, 'then it is served from the cache');

  cache.clear();
  const refused = Array.from({ length: 5 }, () => authenticate(db, `Bearer svc_test_${'0'.repeat(40)}`, { cache }));
  for (const attempt of refused) await t.rejects(attempt, { code: 'invalid_api_key' });
  t.equal(acquired, 2, 'an unknown key is read once for the 5 requests too');
  t.equal(cache.size, 0, 'and is no entry of the cache');
});

t.test('while the LISTEN connection is down, requests that miss the same key at once still share one read, and nothing is cached', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const pool = createPool(gateway.databaseUrl, { max: 10, applicationName: 'key-reads-test', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  let acquired = 0;
  pool.on('acquire', () => acquired++);
  const db = createDb(pool);
  const listener = fakeListener();
  listener.listening = false;
  const cache = new KeyCache(listener);
  // The bound on reads of keys not in the cache (2 statements under way, 256 keys waiting): 300
  // requests of one key, each with a read of its own, would have 42 of them refused 503.
  const reads = new KeyReads(db);

  const outcomes = await Promise.allSettled(Array.from({ length: 300 }, () => authenticate(db, `Bearer ${key.api_key}`, { cache, reads })));
  t.equal(outcomes.filter((outcome) => outcome.status === 'fulfilled' && outcome.value.keyId === key.id).length, 300, 'every request authenticated');
  t.equal(acquired, 1, 'by one read');
  t.equal(cache.size, 0, 'nothing cached while notifications could be missed');

  await authenticate(db, `Bearer ${key.api_key}`, { cache, reads });
  t.equal(acquired, 2, 'a later request reads the key again');
  const missing = `svc_test_${'0'.repeat(40)}`;
  for (const outcome of await Promise.allSettled(Array.from({ length: 5 }, () => authenticate(db, `Bearer ${missing}`, { cache, reads })))) {
    t.equal(outcome.status === 'rejected' && (outcome.reason as { code?: string }).code, 'invalid_api_key');
  }
  t.equal(acquired, 3, 'an unknown key is read once for 5 requests at once');
  t.equal(cache.misses, 0, 'and not remembered');
});

t.test('an unknown key costs one read however often it comes, and a key created right after works at once', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { METRICS_PORT: '0' } });
  const cache = gateway.keys!;
  const pool = createPool(gateway.databaseUrl, { max: 10, applicationName: 'key-misses-test', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  let acquired = 0;
  pool.on('acquire', () => acquired++);
  const db = createDb(pool);
  let unknown = 0;

  const apiKey = `svc_test_${'U'.repeat(40)}`;
  const codes: string[] = [];
  const attempt = () =>
    authenticate(db, `Bearer ${apiKey}`, { cache, onUnknown: () => unknown++ }).then(
      () => codes.push('accepted'),
      (error: { code: string }) => codes.push(error.code),
    );
  await Promise.all(Array.from({ length: 10 }, attempt));
  for (let i = 0; i < 50; i++) await attempt();
  t.same(new Set(codes), new Set(['invalid_api_key']), 'all refused');
  t.equal(acquired, 1, '60 requests with one unknown key: one read');
  t.equal(unknown, 60, 'each counted as unknown');
  t.equal(cache.misses, 1);

  // Over HTTP: refused, and counted in the metrics; then that very key is created (as `gateway
  // keys create` does, with a key of our choosing). Its creation is announced and the miss
  // forgotten as soon as the NOTIFY arrives, milliseconds after the commit (as a revocation
  // takes effect), rather than the key being refused for the rest of the miss's 5 seconds.
  const client = clientFor(gateway.url, apiKey);
  for (let i = 0; i < 3; i++) t.equal((await client.post({ model: 'm', messages: userMessage() })).status, 401);
  const metrics = await send(gateway.metricsUrl, { path: '/metrics' });
  t.match(metrics.text, /^gateway_unknown_keys_total 3$/m, 'gateway_unknown_keys_total');
  const created = await createKnownKey(gateway, apiKey);
  const createdAt = performance.now();
  let status = 0;
  await until(
    async () => (status = (await clientFor(gateway.url, created).post({ model: 'm', messages: userMessage() })).status) === 202,
    () => `the key created after its miss to be accepted (last answer ${status})`,
    // Well under the unknown-key cache's 5 s: without the announcement of its creation, it would be refused that long.
    2_000,
  );
  t.pass(`a key created right after its miss is accepted ${Math.round(performance.now() - createdAt)} ms after its creation`);
  t.equal(cache.misses, 0, 'the miss is forgotten');
});

/** A stand-in for the LISTEN connection: announcements are made by hand. */
function fakeListener() {
  const handlers: { notification(payload: string): void }[] = [];
  const listener = {
    listening: true,
    subscribe: (_channel: string, handler: { notification(payload: string): void }) => handlers.push(handler),
    announce: (payload: string) => handlers.forEach((handler) => handler.notification(payload)),
  };
  return listener as typeof listener & ConstructorParameters<typeof KeyCache>[0];
}

t.test('a key created while it is being read is not remembered missing, and is read again by the next request', async (t) => {
  const listener = fakeListener();
  const cache = new KeyCache(listener);
  const sha = hashApiKey(`svc_test_${'c'.repeat(32)}`);
  const auth = { keyId: 'key_createdDuringTheRead000', projectId: '1', mode: 'test' as const, signingSecretCiphertext: Buffer.alloc(1), requestDeadlineMs: undefined };
  let finishMiss!: () => void;
  const missing = cache.read(sha, () => new Promise((resolve) => (finishMiss = () => resolve(undefined))));
  listener.announce(`created:${auth.keyId}`);
  const after = cache.read(sha, async () => auth);
  t.equal((await after)?.keyId, auth.keyId, 'a request after the creation does not share the read begun before it');
  finishMiss();
  t.equal(await missing, undefined);
  t.notOk(cache.missed(sha), 'the older read\'s miss is not remembered');
  t.equal(cache.get(sha)?.keyId, auth.keyId, 'the key is cached');

  // A creation leaves a read of a key under way to be cached (it is no revocation).
  const other = hashApiKey(`svc_test_${'d'.repeat(32)}`);
  let finishRead!: () => void;
  const reading = cache.read(other, () => new Promise((resolve) => (finishRead = () => resolve({ ...auth, keyId: 'key_readAcrossACreation0000' }))));
  listener.announce('created:key_someOtherKeyCreated000');
  finishRead();
  await reading;
  t.equal(cache.get(other)?.keyId, 'key_readAcrossACreation0000');
});

t.test('a miss is not remembered while notifications could be missed, nor past its few seconds', async (t) => {
  const listener = fakeListener();
  const cache = new KeyCache(listener, { missTtlMs: 100, maxMisses: 2 });
  let reads = 0;
  const read = async () => {
    reads++;
    return undefined;
  };
  const sha = (n: number) => hashApiKey(`svc_test_${String(n).repeat(32)}`);
  for (const n of [1, 2, 3]) await cache.read(sha(n), read);
  t.equal(cache.misses, 2, 'at most maxMisses remembered');
  t.notOk(cache.missed(sha(1)), 'the oldest made room');
  t.ok(cache.missed(sha(3)));
  await new Promise((resolve) => setTimeout(resolve, 150));
  t.notOk(cache.missed(sha(3)), 'forgotten after its time');
  listener.listening = false;
  await cache.read(sha(4), read);
  t.notOk(cache.missed(sha(4)), 'nothing remembered without notifications');
  listener.listening = true;
  t.notOk(cache.missed(sha(4)), 'nor found once they can be heard again');
  t.equal(reads, 4);
});

t.test('a miss after an invalidation does not join a read begun before it', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const cache = gateway.keys!;
  const sha = hashApiKey(`svc_test_${'a'.repeat(32)}`);
  const auth = (keyId: string) => ({ keyId, projectId: '1', mode: 'test' as const, signingSecretCiphertext: Buffer.alloc(1), requestDeadlineMs: undefined });
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

t.test('keys are kept for their time, at most maxEntries of them, the least recently used making room; a change forgets one by its id', async (t) => {
  const listener = fakeListener();
  const cache = new KeyCache(listener, { ttlMs: 200, maxEntries: 2 });
  const sha = (n: number) => hashApiKey(`svc_test_${String(n).repeat(32)}`);
  const auth = (n: number) => ({ keyId: `key_entry${n}`, projectId: '1', mode: 'test' as const, signingSecretCiphertext: Buffer.alloc(1), requestDeadlineMs: undefined });
  for (const n of [1, 2]) await cache.read(sha(n), async () => auth(n));
  t.equal(cache.get(sha(1))?.keyId, 'key_entry1', 'the first, used again');
  await cache.read(sha(3), async () => auth(3));
  t.equal(cache.size, 2, 'at most maxEntries kept');
  t.notOk(cache.get(sha(2)), 'the least recently used made room');
  t.equal(cache.get(sha(3))?.keyId, 'key_entry3');

  // The signing key is prepared once per entry, for the auth the entry holds.
  const cached = cache.get(sha(1))!;
  let prepared = 0;
  const prepare = () => {
    prepared++;
    return {} as import('node:crypto').KeyObject;
  };
  t.equal(cache.signingKey(cached, prepare), cache.signingKey(cached, prepare), 'the same signing key twice');
  t.equal(prepared, 1, 'prepared once');
  listener.announce('key_entry1');
  t.notOk(cache.get(sha(1)), 'a change announced by key id forgets that key');
  cache.signingKey(cached, prepare);
  t.equal(prepared, 2, 'and its signing key: prepared again, not kept');
  t.equal(cache.get(sha(3))?.keyId, 'key_entry3', 'the others stay');

  await new Promise((resolve) => setTimeout(resolve, 250));
  t.notOk(cache.get(sha(3)), 'forgotten after its time');
  let reads = 0;
  t.equal((await cache.read(sha(3), async () => (reads++, auth(3))))?.keyId, 'key_entry3', 'and read again');
  t.equal(reads, 1);
});
