// requests.cancel against a tiny fake gateway on loopback that answers each call from a script
// and records what arrived on the wire: method, path, headers and body bytes.
import http from 'node:http';
import t from 'tap';
import {
  APIError,
  ConflictError,
  Gateway,
  GatewayError,
  InternalServerError,
  NotFoundError,
  type CancelledRequestRecord,
  type RequestRecord,
} from '../../src/client/index.ts';
import { listenOnLoopback } from '../helpers/ports.ts';
import { API_KEY, SECRET, checkSignature, record } from './support.ts';

const ID = 'req_0123456789abcdefghijklmn';

interface Received {
  method: string;
  path: string;
  headers: http.IncomingHttpHeaders;
  body: Buffer;
}

interface Answer {
  status: number;
  body: unknown;
  headers?: Record<string, string>;
}

/** A fake gateway answering the nth call with `answers[n]` (the last one repeats). */
async function fakeGateway(t: Parameters<typeof listenOnLoopback>[0], answers: Answer[]) {
  const received: Received[] = [];
  const server = http.createServer(async (request, response) => {
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    received.push({ method: request.method ?? '', path: request.url ?? '', headers: request.headers, body: Buffer.concat(chunks) });
    const answer = answers[Math.min(received.length - 1, answers.length - 1)]!;
    response.writeHead(answer.status, { 'content-type': 'application/json', ...answer.headers });
    response.end(JSON.stringify(answer.body));
  });
  const port = await listenOnLoopback(t, server);
  const client = new Gateway({ apiKey: API_KEY, signingSecret: SECRET, baseURL: `http://127.0.0.1:${port}` });
  return { client, received };
}

const errorBody = (type: string, code: string) => ({ error: { message: `${code} happened`, type, code, param: null } });
const alreadyFinished = { status: 409, body: errorBody('invalid_request_error', 'request_already_finished'), headers: { 'retry-after': '0' } };
const cancelled = record('cancelled', { attempts: 2, last_error_code: 'upstream_server_error' });

t.test('cancel POSTs to /v1/requests/<id>/cancel with no body, signed over the empty body, and returns the record', async (t) => {
  const { client, received } = await fakeGateway(t, [{ status: 200, body: cancelled }]);

  const result: RequestRecord = await client.requests.cancel(ID);

  t.same(result, cancelled);
  t.equal(result.status, 'cancelled');
  if (result.status === 'cancelled') {
    const narrowed: CancelledRequestRecord = result;
    t.equal(narrowed.last_error_code, 'upstream_server_error', 'the last error code is kept');
  }
  t.equal(received.length, 1);
  const call = received[0]!;
  t.equal(call.method, 'POST');
  t.equal(call.path, `/v1/requests/${ID}/cancel`);
  t.equal(call.body.length, 0, 'no body');
  t.equal(call.headers['content-type'], undefined, 'no Content-Type for no body');
  t.equal(call.headers.authorization, `Bearer ${API_KEY}`);
  const signature = checkSignature(call.headers['svc-signature'] as string, {
    secret: SECRET,
    method: 'POST',
    path: `/v1/requests/${ID}/cancel`,
    body: '',
  });
  t.ok(signature.valid, 'signed over POST, the cancel path and the SHA-256 of the empty string');
});

t.test('cancel percent-encodes the id in the path it sends and signs', async (t) => {
  const { client, received } = await fakeGateway(t, [{ status: 200, body: cancelled }]);
  await client.requests.cancel('req_a/b c');
  t.equal(received[0]!.path, '/v1/requests/req_a%2Fb%20c/cancel');
  t.ok(
    checkSignature(received[0]!.headers['svc-signature'] as string, { secret: SECRET, method: 'POST', path: received[0]!.path, body: '' })
      .valid,
  );
});

t.test('cancelling a finished request throws ConflictError request_already_finished after one call, without a retry', async (t) => {
  const { client, received } = await fakeGateway(t, [alreadyFinished, { status: 200, body: cancelled }]);

  const error = await client.requests.cancel(ID).catch((caught: unknown) => caught);

  t.type(error, ConflictError);
  t.equal((error as ConflictError).status, 409);
  t.equal((error as ConflictError).type, 'invalid_request_error');
  t.equal((error as ConflictError).code, 'request_already_finished');
  t.equal(received.length, 1, 'one call: retrying cannot unfinish the request');
});

t.test('a 503 on cancel is retried, freshly signed, and the record of the retry returned', async (t) => {
  const unavailable = { status: 503, body: errorBody('api_error', 'service_unavailable'), headers: { 'retry-after': '0' } };
  const { client, received } = await fakeGateway(t, [unavailable, { status: 200, body: cancelled }]);

  const result = await client.requests.cancel(ID);

  t.same(result, cancelled);
  t.equal(received.length, 2, 'the 503 and the retry');
  const signatures = received.map((call) =>
    checkSignature(call.headers['svc-signature'] as string, { secret: SECRET, method: 'POST', path: call.path, body: call.body }),
  );
  t.ok(signatures.every((signature) => signature.valid), 'both attempts validly signed');
  t.not(signatures[0]!.nonce, signatures[1]!.nonce, 'each attempt with a nonce of its own');
});

t.test('a 503 that lasts throws InternalServerError after maxRetries retries', async (t) => {
  const unavailable = { status: 503, body: errorBody('api_error', 'service_unavailable'), headers: { 'retry-after': '0' } };
  const { client, received } = await fakeGateway(t, [unavailable]);
  await t.rejects(client.requests.cancel(ID, { maxRetries: 1 }), InternalServerError);
  t.equal(received.length, 2);
});

t.test('cancelling an unknown id throws NotFoundError request_not_found, not retried', async (t) => {
  const { client, received } = await fakeGateway(t, [{ status: 404, body: errorBody('not_found_error', 'request_not_found') }]);
  const error = await client.requests.cancel('req_unknown').catch((caught: unknown) => caught);
  t.type(error, NotFoundError);
  t.equal((error as NotFoundError).code, 'request_not_found');
  t.equal(received.length, 1);
});

t.test('an id of . or .. is refused with a GatewayError, not sent to the route a URL resolves it to', async (t) => {
  const { client, received } = await fakeGateway(t, [{ status: 405, body: errorBody('invalid_request_error', 'method_not_allowed') }]);
  for (const id of ['.', '..']) {
    for (const [call, promise] of [
      ['cancel', client.requests.cancel(id)],
      ['get', client.requests.get(id)],
    ] as const) {
      const error = await promise.catch((caught: unknown) => caught);
      t.type(error, GatewayError, `${call}('${id}')`);
      t.notOk(error instanceof APIError, `${call}('${id}'): no answer, as nothing was sent`);
    }
  }
  t.same(received.map((call) => `${call.method} ${call.path}`), [], 'nothing reached the server (POST /v1/requests/cancel, GET /v1/, ...)');
  await client.requests.get('.x').catch(() => undefined);
  t.equal(received[0]?.path, '/v1/requests/.x', 'a dot within an id is sent as is');
});
