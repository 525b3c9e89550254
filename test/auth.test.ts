// Authentication (docs/api.md, "Authentication and keys"; docs/errors.md) and request signing
// (docs/signing.md): each way a request can be unauthenticated or wrongly signed gets 401 with its
// own code, and stores nothing.
import t from 'tap';
import { revokeKey } from '../src/keys/service.ts';
import { createLogger } from '../src/logger.ts';
import { cleanupNoncesTask } from '../src/worker/cleanup-nonces.ts';
import { startTestGateway, type TestGateway } from './helpers/gateway.ts';
import { clientFor, send, userMessage } from './helpers/http.ts';
import { countRows } from './helpers/rows.ts';
import { newNonce, signature } from './helpers/signing.ts';
import { until } from './helpers/wait.ts';

const body = JSON.stringify({ model: 'test-model', messages: userMessage() });
const PATH = '/v1/chat/completions';

async function nonceCount(gateway: TestGateway): Promise<number> {
  return Number((await gateway.pool.query('select count(*) from gateway.signature_nonces')).rows[0].count);
}

t.test('API keys', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const post = (headers: Record<string, string>, payload: string = body) =>
    send(gateway.url, { path: PATH, body: payload, headers, key: null });

  const cases: [string, Promise<Awaited<ReturnType<typeof post>>>, string][] = [
    ['no Authorization header', post({}), 'missing_api_key'],
    ['an empty Authorization header', post({ authorization: '' }), 'missing_api_key'],
    ['a Basic credential', post({ authorization: `Basic ${Buffer.from('a:b').toString('base64')}` }), 'invalid_api_key'],
    ['a key of the wrong format', post({ authorization: 'Bearer sk-123' }), 'invalid_api_key'],
    ['an unknown key', post({ authorization: `Bearer svc_test_${'A'.repeat(40)}` }), 'invalid_api_key'],
    ['a known key with its mode prefix changed', post({ authorization: `Bearer ${key.api_key.replace('svc_test_', 'svc_live_')}` }), 'invalid_api_key'],
    ['a bad key with a malformed body', post({ authorization: 'Bearer nope' }, '{not json'), 'invalid_api_key'],
    ['a bad key with a wrong content type', post({ authorization: 'Bearer nope', 'content-type': 'text/plain' }), 'invalid_api_key'],
  ];
  for (const [name, pending, code] of cases) {
    const answer = await pending;
    t.equal(answer.status, 401, `${name}: 401`);
    t.same(answer.body.error, { message: answer.body.error.message, type: 'authentication_error', code, param: null }, `${name}: ${code}`);
  }
  const lookup = await send(gateway.url, { path: '/v1/requests/req_00000000000000000000', key: null });
  t.equal(lookup.status, 401, 'the lookup needs a key too');
  t.equal(lookup.body.error.code, 'missing_api_key');
  t.equal(await countRows(gateway.db, 'requests'), 0, 'nothing stored');
});

t.test('a revoked key authenticates nothing', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const client = clientFor(gateway.url, key);
  const accepted = await client.post({ model: 'm', messages: userMessage() });
  t.equal(accepted.status, 202);

  t.equal(gateway.keys!.size, 1, 'the key is cached');
  t.ok(await revokeKey(gateway.db, key.id));
  // The revocation's NOTIFY reaches the API: the cached key is dropped.
  await until(() => gateway.keys!.size === 0, 'the revoked key to leave the cache');
  const refused = await client.post({ model: 'm', messages: userMessage() });
  t.equal(refused.status, 401);
  t.equal(refused.body.error.code, 'invalid_api_key');
  const lookup = await client.get(accepted.body.id);
  t.equal(lookup.status, 401);
  t.equal(await countRows(gateway.db, 'requests'), 1, 'only the request made before the revocation');
});

t.test('signatures', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const otherKey = await gateway.createKey();
  const now = Math.floor(Date.now() / 1000);
  const post = (svcSignature: string | undefined, payload = body, path = PATH, method = 'POST') =>
    send(gateway.url, {
      method,
      path,
      body: payload,
      key: key.api_key,
      headers: svcSignature === undefined ? {} : { 'svc-signature': svcSignature },
    });
  const sign = (parts: Partial<Parameters<typeof signature>[0]> = {}) =>
    signature({ secret: key.signing_secret, method: 'POST', path: PATH, body, ...parts });

  const good = await post(sign());
  t.equal(good.status, 202, 'a correct signature passes');
  t.equal(await nonceCount(gateway), 1, 'its nonce is recorded');

  const tampered = sign({ timestamp: now });
  const refused: [string, Promise<Awaited<ReturnType<typeof post>>>, string][] = [
    ['no signature', post(undefined), 'missing_signature'],
    ['a changed body', post(sign(), body.replace('Hello', 'Hellp')), 'invalid_signature'],
    ['a changed path', post(sign({ path: `${PATH}?x=1` })), 'invalid_signature'],
    ['a changed query', post(sign({ path: `${PATH}?x=1` }), body, `${PATH}?x=2`), 'invalid_signature'],
    ['a changed method', post(sign({ method: 'PUT' })), 'invalid_signature'],
    ['a changed timestamp', post(tampered.replace(`t=${now}`, `t=${now - 1}`)), 'invalid_signature'],
    ['a wrong secret', post(sign({ secret: otherKey.signing_secret })), 'invalid_signature'],
    ['a timestamp 301 s old', post(sign({ timestamp: now - 301 })), 'signature_expired'],
    // Signed as it is sent, one second further: a second may tick between signing and the
    // server's check, and 301 or 302 s ahead are both past the window (300 would not be).
    ['a timestamp 301 s ahead', post(sign({ timestamp: Math.floor(Date.now() / 1000) + 302 })), 'signature_expired'],
    ['a malformed header', post('v1=abc'), 'invalid_signature'],
    ['a nonce that is too short', post(sign({ nonce: 'short' })), 'invalid_signature'],
    ['an upper-case digest', post(sign().replace(/v1=(\w+)/, (_m, hex: string) => `v1=${hex.toUpperCase()}`)), 'invalid_signature'],
  ];
  for (const [name, pending, code] of refused) {
    const answer = await pending;
    t.equal(answer.status, 401, `${name}: 401`);
    t.equal(answer.body.error?.type, 'authentication_error', `${name}: authentication_error`);
    t.equal(answer.body.error?.code, code, `${name}: ${code}`);
  }
  t.equal(await countRows(gateway.db, 'requests'), 1, 'nothing stored for the refused requests');
  t.equal(await nonceCount(gateway), 1, 'and no nonce');

  const nearEdge = await post(sign({ timestamp: Math.floor(Date.now() / 1000) - 295 }));
  t.equal(nearEdge.status, 202, 'a timestamp inside the window passes');

  // t is signed as it is sent: the digits, not the number they make.
  const leadingZero = await post(sign({ timestamp: `0${Math.floor(Date.now() / 1000)}` }));
  t.equal(leadingZero.status, 202, 'a t with a leading zero, signed as sent, passes');
  const zeroAdded = sign({ timestamp: Math.floor(Date.now() / 1000) }).replace('t=', 't=0');
  const notAsSigned = await post(zeroAdded);
  t.equal(notAsSigned.status, 401, 'a leading zero added after signing does not');
  t.equal(notAsSigned.body.error.code, 'invalid_signature');
});

t.test('an empty Svc-Signature header is a malformed signature, not a missing one, in both modes', async (t) => {
  for (const mode of ['required', 'optional']) {
    const gateway = await startTestGateway(t, { role: 'api', env: { SIGNATURES: mode } });
    const key = await gateway.createKey();
    const created = await send(gateway.url, { path: PATH, body, key: key.api_key, headers: { 'svc-signature': '' } });
    t.equal(created.status, 401, `SIGNATURES=${mode}: a POST with it is refused`);
    t.equal(created.body.error.code, 'invalid_signature', `SIGNATURES=${mode}: invalid_signature`);
    const lookup = await send(gateway.url, {
      path: '/v1/requests/req_00000000000000000000',
      key: key.api_key,
      headers: { 'svc-signature': '' },
    });
    t.equal(lookup.status, 401, `SIGNATURES=${mode}: a lookup with it is refused`);
    t.equal(lookup.body.error.code, 'invalid_signature');
    t.equal(await countRows(gateway.db, 'requests'), 0, 'nothing stored');
  }
});

t.test('a replayed nonce is refused and stores nothing', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const header = signature({ secret: key.signing_secret, method: 'POST', path: PATH, body });
  const replay = () =>
    send(gateway.url, { path: PATH, body, key: key.api_key, headers: { 'svc-signature': header } });

  t.equal((await replay()).status, 202);
  const second = await replay();
  t.equal(second.status, 401);
  t.equal(second.body.error.code, 'replayed_request');
  t.equal(await countRows(gateway.db, 'requests'), 1);

  // The same nonce under another key is another key's business.
  const otherKey = await gateway.createKey();
  const nonce = /n=([^,]+)/.exec(header)![1]!;
  const other = await send(gateway.url, {
    path: PATH,
    body,
    key: otherKey.api_key,
    headers: { 'svc-signature': signature({ secret: otherKey.signing_secret, method: 'POST', path: PATH, body, nonce }) },
  });
  t.equal(other.status, 202);
});

t.test('lookups are signed too, and may repeat a nonce', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const created = await clientFor(gateway.url, key).post({ model: 'm', messages: userMessage() });
  const path = `/v1/requests/${created.body.id}`;

  const unsigned = await send(gateway.url, { path, key: key.api_key });
  t.equal(unsigned.status, 401);
  t.equal(unsigned.body.error.code, 'missing_signature');

  const header = signature({ secret: key.signing_secret, method: 'GET', path });
  for (const attempt of [1, 2]) {
    const answer = await send(gateway.url, { path, key: key.api_key, headers: { 'svc-signature': header } });
    t.equal(answer.status, 200, `signed lookup ${attempt}`);
  }
  const wrongPath = await send(gateway.url, {
    path,
    key: key.api_key,
    headers: { 'svc-signature': signature({ secret: key.signing_secret, method: 'GET', path: `${path}x` }) },
  });
  t.equal(wrongPath.body.error.code, 'invalid_signature');
});

t.test('SIGNATURES=optional accepts unsigned requests but still checks a signature that is sent', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { SIGNATURES: 'optional' } });
  const key = await gateway.createKey();
  const unsigned = await send(gateway.url, { path: PATH, body, key: key.api_key });
  t.equal(unsigned.status, 202);
  const badlySigned = await send(gateway.url, {
    path: PATH,
    body,
    key: key.api_key,
    headers: { 'svc-signature': signature({ secret: 'svc_sig_wrong', method: 'POST', path: PATH, body }) },
  });
  t.equal(badlySigned.status, 401);
  t.equal(badlySigned.body.error.code, 'invalid_signature');
  const lookup = await send(gateway.url, { path: `/v1/requests/${unsigned.body.id}`, key: key.api_key });
  t.equal(lookup.status, 200);
});

t.test('a request refused for reusing an idempotency key gives its nonce back', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  t.equal((await client.post({ model: 'm', messages: userMessage('one'), idempotency_key: 'k' })).status, 202);
  t.equal(await nonceCount(gateway), 1);
  const conflict = await client.post({ model: 'm', messages: userMessage('two'), idempotency_key: 'k' });
  t.equal(conflict.status, 422);
  t.equal(await nonceCount(gateway), 1, 'the refused request left no nonce');
});

t.test('the cleanup task deletes expired nonces only', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  await gateway.pool.query(
    `insert into gateway.signature_nonces (api_key_id, nonce, expires_at)
     select $1, 'expired-nonce-' || lpad(i::text, 6, '0'), now() - interval '1 second' from generate_series(1, 12000) as i`,
    [key.id],
  );
  await gateway.pool.query(
    `insert into gateway.signature_nonces (api_key_id, nonce, expires_at) values ($1, $2, now() + interval '5 minutes')`,
    [key.id, newNonce()],
  );
  const task = cleanupNoncesTask({ db: gateway.db, logger: createLogger({ logLevel: 'silent' }) });
  await task({}, {} as never);
  const { rows } = await gateway.pool.query('select expires_at > now() as live from gateway.signature_nonces');
  t.same(rows, [{ live: true }], 'only the unexpired nonce is left');
});
