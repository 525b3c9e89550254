import { createHash, createHmac } from 'node:crypto';
import { inspect } from 'node:util';
import t from 'tap';
import {
  Gateway,
  createNonce,
  createSigningFetch,
  sha256Hex,
  signRequest,
  stringToSign,
} from '../../src/client/index.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { API_KEY, BASE_URL, SECRET, checkCall, checkSignature, completion, jsonResponse, scriptedFetch } from './support.ts';

const hmacHex = (payload: string) => createHmac('sha256', Buffer.from(SECRET, 'utf8')).update(payload).digest('hex');
const sha256 = (body: string | Buffer) => createHash('sha256').update(body).digest('hex');

t.test('signRequest gives the HMAC-SHA256 of the six lines, as node:crypto computes it', async (t) => {
  const body = '{"model":"m","messages":[{"role":"user","content":"héllo ✓"}]}';
  const signed = await signRequest({
    signingSecret: SECRET,
    method: 'post',
    path: '/v1/chat/completions',
    body,
    timestamp: 1_776_000_000,
    nonce: 'abcdefghijklmnop_-12',
  });
  const expected = hmacHex(
    ['v1', '1776000000', 'abcdefghijklmnop_-12', 'POST', '/v1/chat/completions', sha256(Buffer.from(body, 'utf8'))].join('\n'),
  );
  t.equal(signed.signature, expected);
  t.equal(signed.header, `t=1776000000,n=abcdefghijklmnop_-12,v1=${expected}`);
  t.equal(signed.timestamp, 1_776_000_000);
  t.equal(signed.nonce, 'abcdefghijklmnop_-12');
});

t.test('a request without a body is signed over the SHA-256 of the empty string, query included', async (t) => {
  const signed = await signRequest({ signingSecret: SECRET, method: 'GET', path: '/v1/requests/req_1?x=1', timestamp: 5, nonce: 'n'.repeat(16) });
  const emptySha = 'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855';
  t.equal(await sha256Hex(undefined), emptySha);
  t.equal(await sha256Hex(''), emptySha);
  t.equal(signed.signature, hmacHex(['v1', '5', 'n'.repeat(16), 'GET', '/v1/requests/req_1?x=1', emptySha].join('\n')));
});

t.test('bytes and strings with the same content sign alike, over the six lines stringToSign shows', async (t) => {
  const parts = { signingSecret: SECRET, method: 'POST', path: '/v1/chat/completions', timestamp: 7, nonce: 'q'.repeat(20) };
  const fromString = await signRequest({ ...parts, body: '{"a":"ü"}' });
  const fromBytes = await signRequest({ ...parts, body: new TextEncoder().encode('{"a":"ü"}') });
  t.equal(fromBytes.signature, fromString.signature);
  t.equal(stringToSign({ timestamp: 7, nonce: 'x', method: 'get', path: '/v1/p', bodySha256: 'h' }), 'v1\n7\nx\nGET\n/v1/p\nh');
  t.equal(
    stringToSign({ timestamp: '07', nonce: 'x', method: 'get', path: '/v1/p', bodySha256: 'h' }),
    'v1\n07\nx\nGET\n/v1/p\nh',
    't given as the digits sent is signed as those digits',
  );
});

t.test('a default signature carries the current time and a fresh nonce of 16 to 64 [A-Za-z0-9_-]', async (t) => {
  const before = Math.floor(Date.now() / 1000);
  const first = await signRequest({ signingSecret: SECRET, method: 'GET', path: '/v1/requests/x' });
  const second = await signRequest({ signingSecret: SECRET, method: 'GET', path: '/v1/requests/x' });
  t.ok(first.timestamp >= before && first.timestamp <= Math.ceil(Date.now() / 1000));
  t.match(first.nonce, /^[A-Za-z0-9_-]{16,64}$/);
  t.not(first.nonce, second.nonce);
  const nonces = new Set(Array.from({ length: 1000 }, createNonce));
  t.equal(nonces.size, 1000, 'no two of 1000 nonces are equal');
  t.ok([...nonces].every((nonce) => /^[A-Za-z0-9_-]{16,64}$/.test(nonce)));
});

t.test('the client signs the path relative to a base URL that has a path prefix', async (t) => {
  const { fetch, calls } = scriptedFetch([jsonResponse(200, completion())]);
  const client = new Gateway({ apiKey: API_KEY, signingSecret: SECRET, baseURL: 'https://example.com/gateway/', fetch });
  await client.chat.completions.create({ model: 'm', messages: [{ role: 'user', content: 'hi' }], wait: true });

  const call = calls[0]!;
  t.equal(call.url, 'https://example.com/gateway/v1/chat/completions');
  const checked = checkSignature(call.headers.get('svc-signature'), {
    secret: SECRET,
    method: 'POST',
    path: '/v1/chat/completions',
    body: call.body,
  });
  t.ok(checked.valid, 'signed over /v1/chat/completions, not /gateway/v1/...');
  t.equal(call.headers.get('authorization'), `Bearer ${API_KEY}`);
  t.equal(call.headers.get('content-type'), 'application/json');
});

t.test('the client signs a GET as sent: path with the id percent-encoded and no body', async (t) => {
  const { fetch, calls } = scriptedFetch([jsonResponse(200, { id: 'x' })]);
  const client = new Gateway({ apiKey: API_KEY, signingSecret: SECRET, baseURL: BASE_URL, fetch });
  await client.requests.get('req_a/b c');
  const call = calls[0]!;
  t.equal(new URL(call.url).pathname, '/v1/requests/req_a%2Fb%20c');
  t.equal(call.body, '');
  t.ok(checkCall(call).valid);
});

t.test('the signing fetch signs the exact bytes, method and path the caller sends, over the SDK base URL', async (t) => {
  const { fetch: inner, calls } = scriptedFetch([jsonResponse(200, {})]);
  const signingFetch = createSigningFetch({ signingSecret: SECRET, baseURL: 'http://127.0.0.1:1234/v1', fetch: inner });

  const body = '{ "model": "m",  "messages": [] }'; // odd spacing: the bytes, not a re-serialization, are signed
  await signingFetch('http://127.0.0.1:1234/v1/chat/completions?debug=1', {
    method: 'post',
    headers: { 'content-type': 'application/json', authorization: `Bearer ${API_KEY}` },
    body,
  });
  await signingFetch(new URL('http://127.0.0.1:1234/v1/requests/req_1'));
  await signingFetch('http://127.0.0.1:1234/v1/chat/completions', { method: 'POST', body: new TextEncoder().encode(body) });

  t.equal(calls[0]!.body, body);
  t.equal(calls[0]!.method, 'POST');
  t.equal(calls[0]!.headers.get('authorization'), `Bearer ${API_KEY}`, "the caller's headers pass through");
  t.ok(checkSignature(calls[0]!.headers.get('svc-signature'), { secret: SECRET, method: 'POST', path: '/v1/chat/completions?debug=1', body }).valid);
  t.ok(checkSignature(calls[1]!.headers.get('svc-signature'), { secret: SECRET, method: 'GET', path: '/v1/requests/req_1', body: '' }).valid);
  t.ok(checkSignature(calls[2]!.headers.get('svc-signature'), { secret: SECRET, method: 'POST', path: '/v1/chat/completions', body }).valid);
});

t.test('the signing fetch signs each call afresh and refuses URLs outside its base URL', async (t) => {
  const { fetch: inner, calls } = scriptedFetch([jsonResponse(200, {})]);
  const signingFetch = createSigningFetch({ signingSecret: SECRET, baseURL: 'http://host.test/gateway', fetch: inner });
  await signingFetch('http://host.test/gateway/v1/chat/completions', { method: 'POST', body: '{}' });
  await signingFetch('http://host.test/gateway/v1/chat/completions', { method: 'POST', body: '{}' });
  const [first, second] = calls.map((call) =>
    checkSignature(call.headers.get('svc-signature'), { secret: SECRET, method: 'POST', path: '/v1/chat/completions', body: '{}' }),
  );
  t.ok(first!.valid && second!.valid);
  t.not(first!.nonce, second!.nonce);

  await t.rejects(signingFetch('http://other.test/gateway/v1/chat/completions'), /not under the gateway's base URL/);
  await t.rejects(signingFetch('http://host.test/v1/chat/completions'), /not under the gateway's base URL/);
  t.equal(calls.length, 2, 'nothing unsigned was sent');
});

t.test('the signing fetch signs a URL with an empty query (a trailing ?) as sent, and the gateway accepts it', async (t) => {
  const gateway = await startTestGateway(t, { env: { SIGNATURES: 'required' } });
  const key = await gateway.createKey({ mode: 'test' });
  const signingFetch = createSigningFetch({ signingSecret: key.signing_secret });
  const id = 'req_0000000000000000000000';
  for (const query of ['?', '?a=1', '']) {
    const response = await signingFetch(`${gateway.url}/v1/requests/${id}${query}`, {
      headers: { authorization: `Bearer ${key.api_key}` },
    });
    const body = (await response.json()) as { error: { code: string } };
    t.equal(body.error.code, 'request_not_found', `'${query}': the signature is accepted, the id looked up`);
  }
});

t.test('a base URL with a user name or password, which fetch refuses, is refused by new Gateway and createSigningFetch without showing them', async (t) => {
  for (const baseURL of ['http://user:hunter2@127.0.0.1:9', 'http://hunter2@127.0.0.1:9/gateway/v1']) {
    const error = await (async () => {
      const client = new Gateway({ apiKey: API_KEY, signingSecret: SECRET, baseURL, maxRetries: 1 });
      return client.requests.get('req_x');
    })().catch((caught: unknown) => caught);
    t.type(error, TypeError, `${baseURL}: refused as it is given, not a connection error retried`);
    t.notOk(inspect(error).includes('hunter2'), 'the password is not in the error');
    const refusal = (() => {
      try {
        return createSigningFetch({ signingSecret: SECRET, baseURL });
      } catch (caught) {
        return caught;
      }
    })();
    t.type(refusal, TypeError, 'createSigningFetch refuses it too');
    t.notOk(inspect(refusal).includes('hunter2'));
  }
});
