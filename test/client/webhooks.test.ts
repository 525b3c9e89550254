// webhooks.unwrap and signWebhook against the official `standardwebhooks` package: what one
// signs, the other verifies, both ways, so the gateway's deliveries (signed with signWebhook)
// verify with any Standard Webhooks receiver, and the client accepts any conforming sender.
import { randomBytes } from 'node:crypto';
import { Webhook } from 'standardwebhooks';
import t from 'tap';
import {
  APIError,
  Gateway,
  GatewayError,
  WebhookVerificationError,
  Webhooks,
  signWebhook,
  type WebhookEvent,
  type WebhookHeaders,
} from '../../src/client/index.ts';
import { API_KEY, SECRET, completion, record } from './support.ts';

const newSecret = () => `whsec_${randomBytes(32).toString('base64')}`;
const secret = newSecret();
const webhooks = new Gateway({ apiKey: API_KEY, signingSecret: SECRET }).webhooks;

const event = {
  type: 'request.completed',
  timestamp: '2026-04-20T10:00:08.000Z',
  data: record('completed', { result: completion('signed and sealed') }),
};
const payload = JSON.stringify(event);
const msgId = 'msg_2mZkqWsCTXhQbYZ5oFh2ER1p0Nw';

/** The headers the official package would send for `body`, signed with each of `secrets`, at `at` (ms). */
function delivery(body: string, secrets: string[] = [secret], at = Date.now(), id = msgId) {
  return {
    'webhook-id': id,
    'webhook-timestamp': String(Math.floor(at / 1000)),
    'webhook-signature': secrets.map((key) => new Webhook(key).sign(id, new Date(at), body)).join(' '),
  };
}

/** The WebhookVerificationError code unwrap rejects with (fails the test if it resolves or throws another error). */
async function refusal(promise: Promise<WebhookEvent>): Promise<string> {
  const error = await promise.then(
    () => undefined,
    (caught: unknown) => caught,
  );
  if (!(error instanceof WebhookVerificationError)) throw new Error(`expected a WebhookVerificationError, got ${String(error)}`);
  return error.code;
}

t.test('unwrap verifies a delivery signed by standardwebhooks and returns the parsed, typed event', async (t) => {
  const pending = webhooks.unwrap(payload, delivery(payload), secret);
  t.type(pending, Promise, 'unwrap returns a promise');

  const unwrapped = await pending;

  t.same(unwrapped, event);
  t.equal(unwrapped.type, 'request.completed');
  if (unwrapped.type === 'request.completed') {
    t.equal(unwrapped.data.result.choices[0]?.message.content, 'signed and sealed', 'a completed event carries its result');
  }
});

t.test('unwrap takes the body as bytes and the headers as Headers, in any case, or as lists', async (t) => {
  const headers = delivery(payload);
  const bytes = new TextEncoder().encode(payload);
  t.same(await webhooks.unwrap(Buffer.from(payload), headers, secret), event, 'a Buffer');
  t.same(await webhooks.unwrap(bytes, headers, secret), event, 'a Uint8Array');
  t.same(await webhooks.unwrap(bytes.slice().buffer, headers, secret), event, 'an ArrayBuffer');
  t.same(await webhooks.unwrap(payload, new Headers(headers), secret), event, 'a Headers');
  const mixedCase: WebhookHeaders = {
    'Webhook-Id': headers['webhook-id'],
    'WEBHOOK-TIMESTAMP': [headers['webhook-timestamp']],
    'Webhook-Signature': headers['webhook-signature'],
    'content-type': 'application/json',
  };
  t.same(await webhooks.unwrap(payload, mixedCase, secret), event, 'names in any case, a value as a list');
});

t.test('a secret without the whsec_ prefix is taken as base64 too', async (t) => {
  t.same(await webhooks.unwrap(payload, delivery(payload), secret.slice('whsec_'.length)), event);
});

t.test('during a rotation, a delivery signed with the old and the new secret verifies with either', async (t) => {
  const oldSecret = newSecret();
  const headers = delivery(payload, [oldSecret, secret]);
  t.equal(headers['webhook-signature'].split(' ').length, 2);
  t.same(await webhooks.unwrap(payload, headers, oldSecret), event, 'the old secret');
  t.same(await webhooks.unwrap(payload, headers, secret), event, 'the new secret');
  t.equal(await refusal(webhooks.unwrap(payload, headers, newSecret())), 'invalid_signature', 'a third secret');
});

t.test('signatures of other versions than v1 are ignored', async (t) => {
  const v1 = delivery(payload)['webhook-signature'];
  const asV2 = v1.replace(/^v1,/, 'v2,');
  t.equal(await refusal(webhooks.unwrap(payload, { ...delivery(payload), 'webhook-signature': asV2 }, secret)), 'invalid_signature');
  const mixed = `v1a,${v1.slice(3)} v2,${v1.slice(3)} ${v1}`;
  t.same(await webhooks.unwrap(payload, { ...delivery(payload), 'webhook-signature': mixed }, secret), event, 'the v1 entry counts');
});

t.test('a tampered body, id or timestamp, or a wrong secret, is refused with invalid_signature', async (t) => {
  const headers = delivery(payload);
  const tampered = payload.replace('signed and sealed', 'signed and stolen');
  t.equal(await refusal(webhooks.unwrap(tampered, headers, secret)), 'invalid_signature', 'tampered body');
  t.equal(await refusal(webhooks.unwrap(payload, { ...headers, 'webhook-id': 'msg_other' }, secret)), 'invalid_signature', 'another id');
  const earlier = String(Number(headers['webhook-timestamp']) - 1);
  t.equal(await refusal(webhooks.unwrap(payload, { ...headers, 'webhook-timestamp': earlier }, secret)), 'invalid_signature', 'another timestamp');
  t.equal(await refusal(webhooks.unwrap(payload, headers, newSecret())), 'invalid_signature', 'wrong secret');
  t.equal(await refusal(webhooks.unwrap(payload, { ...headers, 'webhook-signature': 'v1,' }, secret)), 'invalid_signature', 'an empty v1 entry');
});

t.test('a missing or empty header is refused with missing_header', async (t) => {
  for (const name of ['webhook-id', 'webhook-timestamp', 'webhook-signature'] as const) {
    const { [name]: _left, ...without } = delivery(payload);
    t.equal(await refusal(webhooks.unwrap(payload, without, secret)), 'missing_header', `without ${name}`);
    t.equal(await refusal(webhooks.unwrap(payload, { ...delivery(payload), [name]: '' }, secret)), 'missing_header', `${name} empty`);
  }
  t.equal(await refusal(webhooks.unwrap(payload, new Headers(), secret)), 'missing_header', 'no headers at all');
});

t.test('a webhook-timestamp that is not Unix seconds is refused with invalid_header', async (t) => {
  for (const value of ['soon', '1776000000.5', '-5', '2026-04-20T10:00:08Z']) {
    t.equal(await refusal(webhooks.unwrap(payload, { ...delivery(payload), 'webhook-timestamp': value }, secret)), 'invalid_header', value);
  }
});

t.test('the timestamp must be within 300 s of now: 301 s old or ahead is refused, 300 s either way accepted', async (t) => {
  const now = Date.now();
  t.capture(Date, 'now', () => now); // one clock for signing and checking: no second ticks over between them

  t.equal(await refusal(webhooks.unwrap(payload, delivery(payload, [secret], now - 301_000), secret)), 'timestamp_too_old');
  t.equal(await refusal(webhooks.unwrap(payload, delivery(payload, [secret], now + 301_000), secret)), 'timestamp_in_future');
  // Whole seconds on both sides, as the header carries them.
  const second = Math.floor(now / 1000) * 1000;
  t.same(await webhooks.unwrap(payload, delivery(payload, [secret], second - 300_000), secret), event, '300 s old');
  t.same(await webhooks.unwrap(payload, delivery(payload, [secret], second + 300_000), secret), event, '300 s ahead');
});

t.test('a validly signed body that is not a JSON event is refused with invalid_body', async (t) => {
  for (const body of ['not json', '[]', 'null', '{"type":"request.completed","data":{}}', '{"type":"request.failed","timestamp":"x","data":null}']) {
    t.equal(await refusal(webhooks.unwrap(body, delivery(body), secret)), 'invalid_body', body);
  }
  const notUtf8 = Uint8Array.of(0x7b, 0xff, 0x7d);
  const timestamp = Math.floor(Date.now() / 1000);
  const headers = {
    'webhook-id': msgId,
    'webhook-timestamp': String(timestamp),
    'webhook-signature': await signWebhook(secret, msgId, timestamp, notUtf8),
  };
  t.equal(await refusal(webhooks.unwrap(notUtf8, headers, secret)), 'invalid_body', 'bytes that are not UTF-8');
});

t.test('a parsed body cannot be verified: unwrap refuses it with a TypeError saying so', async (t) => {
  await t.rejects(webhooks.unwrap(event as never, delivery(payload), secret), {
    name: 'TypeError',
    message: /raw body as received .*not a parsed object/,
  });
  await t.rejects(webhooks.unwrap(undefined as never, delivery(payload), secret), TypeError);
});

t.test('a malformed secret is a TypeError, not a refused delivery', async (t) => {
  await t.rejects(webhooks.unwrap(payload, delivery(payload), 'whsec_not base64!'), { name: 'TypeError', message: /whsec_ followed by base64/ });
  await t.rejects(webhooks.unwrap(payload, delivery(payload), 'whsec_'), { name: 'TypeError', message: /empty/ });
});

t.test('WebhookVerificationError is a GatewayError with a code, not an APIError', async (t) => {
  const error = await webhooks.unwrap(payload, {}, secret).catch((caught: unknown) => caught);
  t.type(error, WebhookVerificationError);
  t.type(error, GatewayError);
  t.notOk(error instanceof APIError, 'nothing was called');
  t.equal((error as WebhookVerificationError).name, 'WebhookVerificationError');
  t.equal((error as WebhookVerificationError).code, 'missing_header');
  t.match((error as WebhookVerificationError).message, /webhook-id/);
});

t.test('new Webhooks() unwraps without a client, for receivers that hold only the endpoint secret', async (t) => {
  t.same(await new Webhooks().unwrap(payload, delivery(payload), secret), event);
});

t.test('signWebhook gives what standardwebhooks signs, and standardwebhooks verifies it', async (t) => {
  const timestamp = Math.floor(Date.now() / 1000);
  const signature = await signWebhook(secret, msgId, timestamp, payload);

  t.match(signature, /^v1,[A-Za-z0-9+/]{43}=$/);
  t.equal(signature, new Webhook(secret).sign(msgId, new Date(timestamp * 1000), payload), 'the same string');
  const headers = { 'webhook-id': msgId, 'webhook-timestamp': String(timestamp), 'webhook-signature': signature };
  t.same(new Webhook(secret).verify(payload, headers), event, 'standardwebhooks verifies it');
  t.equal(await signWebhook(secret, msgId, timestamp, new TextEncoder().encode(payload)), signature, 'bytes sign like the string');
  t.same(await webhooks.unwrap(payload, headers, secret), event, 'and so does unwrap');
});

t.test('a header of two signWebhook signatures verifies with standardwebhooks under either secret', async (t) => {
  const oldSecret = newSecret();
  const timestamp = Math.floor(Date.now() / 1000);
  const signatures = await Promise.all([oldSecret, secret].map((key) => signWebhook(key, msgId, timestamp, payload)));
  const headers = { 'webhook-id': msgId, 'webhook-timestamp': String(timestamp), 'webhook-signature': signatures.join(' ') };
  t.same(new Webhook(oldSecret).verify(payload, headers), event);
  t.same(new Webhook(secret).verify(payload, headers), event);
  t.throws(() => new Webhook(newSecret()).verify(payload, headers), { message: /No matching signature/ });
});

t.test('signWebhook refuses a timestamp that is not whole seconds', async (t) => {
  await t.rejects(signWebhook(secret, msgId, 1.5, payload), TypeError);
  await t.rejects(signWebhook(secret, msgId, Date.now() + 0.5, payload), TypeError);
});
