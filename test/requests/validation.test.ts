// Every rule of the POST body (docs/api.md, "Submitting a request") and how breaking it is
// answered: 400/413/415 in the error shape of docs/errors.md, with the code and param at fault,
// nothing stored.
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send } from '../helpers/http.ts';
import { countRows } from '../helpers/rows.ts';

const valid = { model: 'test-model', messages: [{ role: 'user', content: 'hi' }] };
const message = (fields: Record<string, unknown>) => ({ ...valid, messages: [fields] });

const refused: [name: string, body: unknown, code: string, param: string | null][] = [
  ['model is missing', { messages: valid.messages }, 'missing_parameter', 'model'],
  ['messages are missing', { model: 'm' }, 'missing_parameter', 'messages'],
  ['model is not a string', { ...valid, model: 5 }, 'invalid_parameter', 'model'],
  ['model is empty', { ...valid, model: '' }, 'invalid_parameter', 'model'],
  ['model is longer than 256 characters', { ...valid, model: 'm'.repeat(257) }, 'invalid_parameter', 'model'],
  ['model is longer than 256 characters outside the BMP', { ...valid, model: '\u{1F600}'.repeat(257) }, 'invalid_parameter', 'model'],
  ['model holds a NUL character', { ...valid, model: 'test-\u0000model' }, 'invalid_parameter', 'model'],
  ['messages is not an array', { ...valid, messages: 'hi' }, 'invalid_parameter', 'messages'],
  ['messages is empty', { ...valid, messages: [] }, 'invalid_parameter', 'messages'],
  ['there are 2049 messages', { ...valid, messages: Array(2049).fill(valid.messages[0]) }, 'invalid_parameter', 'messages'],
  ['a message is not an object', { ...valid, messages: ['hi'] }, 'invalid_parameter', 'messages[0]'],
  ['a message has no role', message({ content: 'hi' }), 'missing_parameter', 'messages[0].role'],
  ['a message has no content', message({ role: 'user' }), 'missing_parameter', 'messages[0].content'],
  ['a role is unknown', message({ role: 'tool', content: 'hi' }), 'invalid_parameter', 'messages[0].role'],
  ['a content is null', message({ role: 'user', content: null }), 'invalid_parameter', 'messages[0].content'],
  ['a content is an array', message({ role: 'user', content: [{ type: 'text', text: 'hi' }] }), 'invalid_parameter', 'messages[0].content'],
  ['a message has an extra field', message({ role: 'user', content: 'hi', name: 'bob' }), 'unknown_parameter', 'messages[0].name'],
  ['the second message is wrong', { ...valid, messages: [valid.messages[0], { role: 'user' }] }, 'missing_parameter', 'messages[1].content'],
  ['temperature is below 0', { ...valid, temperature: -0.01 }, 'invalid_parameter', 'temperature'],
  ['temperature is above 2', { ...valid, temperature: 2.01 }, 'invalid_parameter', 'temperature'],
  ['temperature is a string', { ...valid, temperature: '1' }, 'invalid_parameter', 'temperature'],
  ['temperature is null', { ...valid, temperature: null }, 'invalid_parameter', 'temperature'],
  ['top_p is below 0', { ...valid, top_p: -0.1 }, 'invalid_parameter', 'top_p'],
  ['top_p is above 1', { ...valid, top_p: 1.1 }, 'invalid_parameter', 'top_p'],
  ['presence_penalty is below -2', { ...valid, presence_penalty: -2.1 }, 'invalid_parameter', 'presence_penalty'],
  ['presence_penalty is above 2', { ...valid, presence_penalty: 2.1 }, 'invalid_parameter', 'presence_penalty'],
  ['frequency_penalty is below -2', { ...valid, frequency_penalty: -2.1 }, 'invalid_parameter', 'frequency_penalty'],
  ['frequency_penalty is above 2', { ...valid, frequency_penalty: 2.1 }, 'invalid_parameter', 'frequency_penalty'],
  ['max_tokens is 0', { ...valid, max_tokens: 0 }, 'invalid_parameter', 'max_tokens'],
  ['max_tokens is fractional', { ...valid, max_tokens: 1.5 }, 'invalid_parameter', 'max_tokens'],
  ['max_tokens is beyond safe integers', { ...valid, max_tokens: 2 ** 53 }, 'invalid_parameter', 'max_tokens'],
  ['max_tokens is a string', { ...valid, max_tokens: '10' }, 'invalid_parameter', 'max_tokens'],
  ['wait is a string', { ...valid, wait: 'true' }, 'invalid_parameter', 'wait'],
  ['idempotency_key is empty', { ...valid, idempotency_key: '' }, 'invalid_parameter', 'idempotency_key'],
  ['idempotency_key is 256 characters', { ...valid, idempotency_key: 'k'.repeat(256) }, 'invalid_parameter', 'idempotency_key'],
  ['idempotency_key is not ASCII', { ...valid, idempotency_key: 'clé' }, 'invalid_parameter', 'idempotency_key'],
  ['idempotency_key has a control character', { ...valid, idempotency_key: 'a\nb' }, 'invalid_parameter', 'idempotency_key'],
  ['idempotency_key is a number', { ...valid, idempotency_key: 5 }, 'invalid_parameter', 'idempotency_key'],
  ['stream is true', { ...valid, stream: true }, 'stream_not_supported', 'stream'],
  ['stream is a string', { ...valid, stream: 'false' }, 'invalid_parameter', 'stream'],
  ['there is an unknown field', { ...valid, user: 'bob' }, 'unknown_parameter', 'user'],
  ['there are unknown and missing fields', { messages: valid.messages, tools: [] }, 'unknown_parameter', 'tools'],
  ['the body is an array', [valid], 'invalid_body', null],
  ['the body is a string', 'hello', 'invalid_body', null],
  ['the body is null', null, 'invalid_body', null],
];

t.test('bodies that break the contract are refused with its error, and nothing is stored', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { MAX_BODY_BYTES: '600000' } });
  const client = clientFor(gateway.url, await gateway.createKey());

  for (const [name, body, code, param] of refused) {
    const answer = await client.post(JSON.stringify(body));
    t.equal(answer.status, 400, `${name}: 400`);
    t.same(Object.keys(answer.body), ['error'], `${name}: only "error"`);
    t.same(Object.keys(answer.body.error).sort(), ['code', 'message', 'param', 'type'], `${name}: error fields`);
    t.equal(answer.body.error.type, 'invalid_request_error', `${name}: type`);
    t.equal(answer.body.error.code, code, `${name}: code`);
    t.equal(answer.body.error.param, param, `${name}: param`);
    t.ok(answer.body.error.message.length > 10, `${name}: a message for people`);
  }
  t.equal(await countRows(gateway.db, 'requests'), 0, 'no request stored');
  t.equal(Number((await gateway.pool.query('select count(*) from gateway.signature_nonces')).rows[0].count), 0, 'no nonce stored');
});

t.test('malformed JSON, wrong media types and oversized bodies are refused', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { MAX_BODY_BYTES: '2048' } });
  const key = await gateway.createKey();
  const post = (body: string | Buffer, headers: Record<string, string> = {}) =>
    send(gateway.url, { path: '/v1/chat/completions', body, headers, key });

  const cases: [string, Promise<Awaited<ReturnType<typeof post>>>, number, string][] = [
    ['invalid JSON', post('{"model": "m",'), 400, 'invalid_json'],
    ['an empty body', post(''), 400, 'invalid_json'],
    ['invalid UTF-8', post(Buffer.from([0x7b, 0x22, 0xff, 0xfe, 0x22, 0x7d])), 400, 'invalid_json'],
    ['text/plain', post(JSON.stringify(valid), { 'content-type': 'text/plain' }), 415, 'unsupported_media_type'],
    ['form data', post('a=b', { 'content-type': 'application/x-www-form-urlencoded' }), 415, 'unsupported_media_type'],
    ['a charset other than UTF-8', post(JSON.stringify(valid), { 'content-type': 'application/json; charset=latin1' }), 415, 'unsupported_media_type'],
    ['a compressed body', post(JSON.stringify(valid), { 'content-encoding': 'gzip' }), 415, 'unsupported_media_type'],
    ['a body over MAX_BODY_BYTES', post(JSON.stringify({ ...valid, model: 'm'.repeat(3000) })), 413, 'request_too_large'],
  ];
  for (const [name, pending, status, code] of cases) {
    const answer = await pending;
    t.equal(answer.status, status, `${name}: ${status}`);
    t.equal(answer.body.error?.code, code, `${name}: ${code}`);
  }
  const noType = await fetch(`${gateway.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${key.api_key}` },
    body: new Uint8Array(Buffer.from(JSON.stringify(valid))),
  });
  t.equal(noType.status, 415, 'no content type: 415');
  t.equal(await countRows(gateway.db, 'requests'), 0, 'no request stored');
});

t.test('the JSON media type is accepted however its case and spaces are written', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const types = ['Application/JSON', 'APPLICATION/JSON; CHARSET=UTF-8', 'application/json ; charset=utf-8', 'application/json; charset="UTF-8"', ' application/json'];
  for (const type of types) {
    const answer = await send(gateway.url, { path: '/v1/chat/completions', body: JSON.stringify(valid), headers: { 'content-type': type }, key });
    t.equal(answer.status, 202, `${JSON.stringify(type)}: accepted`);
  }
  t.equal(await countRows(gateway.db, 'requests'), types.length);
});

t.test('values at the edges of every range are accepted', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  const accepted = [
    { ...valid, temperature: 0, top_p: 0, presence_penalty: -2, frequency_penalty: -2, max_tokens: 1 },
    { ...valid, temperature: 2, top_p: 1, presence_penalty: 2, frequency_penalty: 2, max_tokens: 2 ** 53 - 1 },
    { ...valid, model: 'm'.repeat(256), stream: false, wait: false },
    // Characters, not UTF-16 units: each of these takes two.
    { ...valid, model: '\u{1F600}'.repeat(256) },
    { ...valid, idempotency_key: ` ~${'k'.repeat(253)}` },
    {
      ...valid,
      messages: ['system', 'developer', 'user', 'assistant'].map((role) => ({ role, content: '' })),
    },
    { ...valid, messages: Array(2048).fill(valid.messages[0]) },
  ];
  for (const body of accepted) {
    const answer = await client.post(body);
    t.equal(answer.status, 202, `accepted: ${JSON.stringify(body).slice(0, 80)}`);
  }
  t.equal(await countRows(gateway.db, 'requests'), accepted.length);
});

t.test('what is stored and sent upstream is the body without wait, idempotency_key and stream', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  const answer = await client.post({
    stream: false,
    wait: false,
    idempotency_key: 'abc',
    max_tokens: 5,
    messages: valid.messages,
    model: 'test-model',
    temperature: 0.5,
  });
  const { rows } = await gateway.pool.query('select body::text as body, model from gateway.requests where id = $1', [
    answer.body.id,
  ]);
  t.same(JSON.parse(rows[0].body), { max_tokens: 5, messages: valid.messages, model: 'test-model', temperature: 0.5 });
  t.equal(rows[0].model, 'test-model');
});

t.test('a body of millions of messages is refused for their number, at once, without each being looked at', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  // 4 MiB (MAX_BODY_BYTES) of messages, each empty or not an object: looking at each made one
  // issue per message, seconds of the event loop and gigabytes of memory for a single request.
  for (const item of ['{}', '1']) {
    const count = Math.floor((4 * 1024 * 1024 - 100) / (item.length + 1));
    const body = `{"model":"m","messages":[${Array(count).fill(item).join(',')}]}`;
    const answer = await client.post(body);
    t.equal(answer.status, 400, `${count} messages ${item}: 400`);
    // Looked at one by one, the first bad message would be answered (missing_parameter, messages[0].role).
    t.same([answer.body.error.code, answer.body.error.param], ['invalid_parameter', 'messages'], 'refused for their number');
  }
  t.equal(await countRows(gateway.db, 'requests'), 0);
});
