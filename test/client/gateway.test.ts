// The client against a real gateway (API and worker on loopback, a database of its own), with
// signatures required as by default.
import t from 'tap';
import {
  AuthenticationError,
  BadRequestError,
  ConflictError,
  Gateway,
  NotFoundError,
  UnprocessableEntityError,
  type ChatMessage,
} from '../../src/client/index.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { waitForRow } from '../helpers/rows.ts';
import { signaturesOf, startFlakyProxy } from './proxy.ts';

const messages = (content = 'Hello there'): ChatMessage[] => [{ role: 'user', content }];

async function setUp(t: Parameters<typeof startTestGateway>[0], env: Record<string, string> = {}) {
  const gateway = await startTestGateway(t, { env: { SIGNATURES: 'required', ...env } });
  const key = await gateway.createKey({ mode: 'test' });
  const client = new Gateway({ apiKey: key.api_key, signingSecret: key.signing_secret, baseURL: gateway.url });
  return { gateway, key, client };
}

async function requestRows(gateway: TestGateway) {
  const { rows } = await gateway.pool.query<{ id: string; status: string; idempotency_key: string | null; result: unknown }>(
    'select id, status, idempotency_key, result from gateway.requests order by created_at',
  );
  return rows;
}

t.test('create with wait: true returns the chat.completion, the one stored', async (t) => {
  const { gateway, client } = await setUp(t);

  const result = await client.chat.completions.create({ model: 'test-delay-100', messages: messages('wait for me'), wait: true });

  t.equal(result.object, 'chat.completion');
  if (result.object !== 'chat.completion') return;
  t.match(result.id, /^chatcmpl-/);
  t.equal(result.choices[0]?.message.content, 'wait for me');
  const rows = await requestRows(gateway);
  t.equal(rows.length, 1);
  t.equal(rows[0]!.status, 'completed');
  t.same(rows[0]!.result, result, 'the answer is the stored result');
  t.match(rows[0]!.idempotency_key, /^auto-/, 'the client generated an idempotency key');
});

t.test('create with wait: false acknowledges; get and poll then give the completed record', async (t) => {
  const { client } = await setUp(t);

  const ack = await client.chat.completions.create({ model: 'test-delay-300', messages: messages('later'), wait: false });

  t.equal(ack.object, 'chat.completion.async');
  if (ack.object !== 'chat.completion.async') return;
  t.equal(ack.status, 'queued');
  t.match(ack.id, /^req_[A-Za-z0-9]{20,40}$/);

  const early = await client.requests.get(ack.id);
  t.equal(early.id, ack.id);
  t.ok(['queued', 'processing'].includes(early.status), `looked up while ${early.status}`);
  t.notOk('result' in early, 'no result before completion');

  const final = await client.requests.poll(ack.id, { pollIntervalMs: 50 });
  t.equal(final.status, 'completed');
  t.equal(final.id, ack.id);
  t.equal(final.attempts, 1);
  t.equal(final.last_error_code, null);
  t.equal(final.status === 'completed' && final.result.object, 'chat.completion');
  t.equal(final.status === 'completed' && final.result.choices[0]?.message.content, 'later');

  const again = await client.requests.get(ack.id);
  t.same(again, final, 'get now gives the same completed record');
  t.same(Object.keys(again).sort(), ['attempts', 'created_at', 'id', 'last_error_code', 'result', 'status', 'updated_at']);
});

t.test('poll returns a failed record with its error code', async (t) => {
  const { client } = await setUp(t);
  const ack = await client.chat.completions.create({ model: 'test-error-400', messages: messages() });
  const final = await client.requests.poll(ack.id, { pollIntervalMs: 50 });
  t.equal(final.status, 'failed');
  t.equal(final.last_error_code, 'upstream_bad_request');
  t.notOk('result' in final);
});

t.test('an unknown request id throws NotFoundError request_not_found', async (t) => {
  const { client } = await setUp(t);
  const error = await client.requests.get('req_0000000000000000000000000000').catch((caught: unknown) => caught);
  t.type(error, NotFoundError);
  t.equal((error as NotFoundError).status, 404);
  t.equal((error as NotFoundError).type, 'not_found_error');
  t.equal((error as NotFoundError).code, 'request_not_found');
});

t.test('the server’s 400 arrives as BadRequestError naming the parameter, and nothing is stored', async (t) => {
  const { gateway, client } = await setUp(t);
  const error = await client.chat.completions
    .create({ model: 'test-echo', messages: messages(), temperature: 5 })
    .catch((caught: unknown) => caught);
  t.type(error, BadRequestError);
  t.equal((error as BadRequestError).code, 'invalid_parameter');
  t.equal((error as BadRequestError).param, 'temperature');
  t.equal((await requestRows(gateway)).length, 0);
});

t.test('reusing an idempotency key with another body throws UnprocessableEntityError', async (t) => {
  const { client } = await setUp(t);
  const first = await client.chat.completions.create({ model: 'test-echo', messages: messages('one'), idempotency_key: 'k-1' });
  const replay = await client.chat.completions.create({ model: 'test-echo', messages: messages('one'), idempotency_key: 'k-1' });
  t.equal(replay.id, first.id, 'the same key and body name the same request');
  const error = await client.chat.completions
    .create({ model: 'test-echo', messages: messages('two'), idempotency_key: 'k-1' })
    .catch((caught: unknown) => caught);
  t.type(error, UnprocessableEntityError);
  t.equal((error as UnprocessableEntityError).code, 'idempotency_key_reused');
  t.equal((error as UnprocessableEntityError).param, 'idempotency_key');
});

t.test('a wrong signing secret is refused with invalid_signature; a wrong key with invalid_api_key', async (t) => {
  const { gateway, key } = await setUp(t);
  const wrongSecret = new Gateway({ apiKey: key.api_key, signingSecret: `svc_sig_${'x'.repeat(40)}`, baseURL: gateway.url });
  const signatureError = await wrongSecret.requests.get('req_0000000000000000000000000000').catch((caught: unknown) => caught);
  t.type(signatureError, AuthenticationError);
  t.equal((signatureError as AuthenticationError).code, 'invalid_signature');

  const wrongKey = new Gateway({ apiKey: `svc_test_${'y'.repeat(40)}`, signingSecret: key.signing_secret, baseURL: gateway.url });
  const keyError = await wrongKey.chat.completions.create({ model: 'm', messages: messages() }).catch((caught: unknown) => caught);
  t.type(keyError, AuthenticationError);
  t.equal((keyError as AuthenticationError).code, 'invalid_api_key');
  t.equal((await requestRows(gateway)).length, 0);
});

t.test('a base URL ending in /v1 names the same gateway', async (t) => {
  const { gateway, key } = await setUp(t);
  const client = new Gateway({ apiKey: key.api_key, signingSecret: key.signing_secret, baseURL: `${gateway.url}/v1/` });
  const result = await client.chat.completions.create({ model: 'test-echo', messages: messages('slash'), wait: true });
  t.equal(result.object, 'chat.completion');
});

t.test('retries through a 503 and a dropped connection make exactly one request', async (t) => {
  const { gateway, key } = await setUp(t);
  // 1: answered 503 by the proxy; 2: reaches the gateway, which stores the request, but the
  // client's connection is dropped before the answer; 3: forwarded, and answered.
  const proxy = await startFlakyProxy(t, gateway.url, ['unavailable', 'forward-then-drop', 'forward']);
  const client = new Gateway({ apiKey: key.api_key, signingSecret: key.signing_secret, baseURL: proxy.url });

  const result = await client.chat.completions.create({ model: 'test-echo', messages: messages('only once'), wait: true });

  t.equal(result.object, 'chat.completion');
  t.equal(proxy.calls.length, 3);
  t.same(proxy.calls.map((call) => call.step), ['unavailable', 'forward-then-drop', 'forward']);

  const rows = await requestRows(gateway);
  t.equal(rows.length, 1, 'exactly one request row');
  t.equal(rows[0]!.status, 'completed');
  t.same(rows[0]!.result, result);

  const bodies = proxy.calls.map((call) => JSON.parse(call.body));
  t.equal(new Set(bodies.map((body) => body.idempotency_key)).size, 1, 'one idempotency key throughout');
  t.equal(rows[0]!.idempotency_key, bodies[0].idempotency_key);
  const signatures = signaturesOf(proxy.calls, key.signing_secret);
  t.ok(signatures.every((signature) => signature.valid), 'every attempt validly signed');
  t.equal(new Set(signatures.map((signature) => signature.nonce)).size, 3, 'a new nonce for each attempt');
  t.equal(proxy.calls[1]!.answer?.status, 200, 'the dropped attempt was accepted by the gateway');
  t.equal(proxy.calls[2]!.answer?.status, 200);
  t.equal(proxy.calls[2]!.answer?.headers.get('idempotent-replayed'), 'true', 'the last attempt was answered as a replay');
});

t.test('cancel: a running request becomes cancelled, a second cancel answers it again, a finished one throws ConflictError', async (t) => {
  const { gateway, client } = await setUp(t, { UPSTREAM_TIMEOUT_MS: '30000' });
  const running = await client.chat.completions.create({ model: 'test-delay-20000', messages: messages('too slow'), wait: false });
  await waitForRow(gateway.db, running.id, (row) => row.status === 'processing', 10_000);
  const cancelled = await client.requests.cancel(running.id);
  t.match(cancelled, { id: running.id, status: 'cancelled', attempts: 1 }, 'cancelled during its first attempt');
  t.same(await client.requests.cancel(running.id), cancelled, 'cancelling it again answers its record again');
  t.match(await client.requests.poll(running.id), { status: 'cancelled' }, 'poll ends on it');
  t.match((await requestRows(gateway)).find((row) => row.id === running.id), { status: 'cancelled' });

  const done = await client.chat.completions.create({ model: 'test-echo', messages: messages(), wait: false });
  await client.requests.poll(done.id);
  const error = await client.requests.cancel(done.id).catch((caught: unknown) => caught);
  t.ok(error instanceof ConflictError, 'ConflictError');
  t.match(error, { status: 409, type: 'invalid_request_error', code: 'request_already_finished' });
  await t.rejects(client.requests.cancel('req_00000000000000000000'), NotFoundError);
});
