// Failures become typed errors, one class per status family, with the contract's fields.
import { inspect } from 'node:util';
import t from 'tap';
import {
  APIError,
  AuthenticationError,
  BadRequestError,
  ConflictError,
  Gateway,
  GatewayError,
  InternalServerError,
  NotFoundError,
  PermissionDeniedError,
  RateLimitError,
  UnprocessableEntityError,
} from '../../src/client/index.ts';
import { API_KEY, BASE_URL, SECRET, errorResponse, scriptedFetch } from './support.ts';

const params = { model: 'm', messages: [{ role: 'user' as const, content: 'hi' }] };

async function failureOf(response: Response, call: 'create' | 'get' = 'create'): Promise<unknown> {
  const { fetch } = scriptedFetch([response]);
  const client = new Gateway({ apiKey: API_KEY, signingSecret: SECRET, baseURL: BASE_URL, fetch, maxRetries: 0 });
  const promise = call === 'create' ? client.chat.completions.create(params) : client.requests.get('req_nope');
  return promise.then(
    () => t.fail('expected a failure'),
    (error: unknown) => error,
  );
}

t.test('400 throws BadRequestError carrying status, type, code, param and message', async (t) => {
  const error = await failureOf(
    errorResponse(400, {
      type: 'invalid_request_error',
      code: 'invalid_parameter',
      param: 'messages[0].role',
      message: "Invalid 'messages[0].role': expected one of ...",
    }),
  );
  t.type(error, BadRequestError);
  t.type(error, APIError);
  t.type(error, GatewayError);
  const e = error as BadRequestError;
  t.equal(e.status, 400);
  t.equal(e.type, 'invalid_request_error');
  t.equal(e.code, 'invalid_parameter');
  t.equal(e.param, 'messages[0].role');
  t.equal(e.message, "400 Invalid 'messages[0].role': expected one of ...");
  t.equal(e.name, 'BadRequestError');
  t.equal(e.headers?.get('content-type'), 'application/json');
  t.same(e.error, {
    message: "Invalid 'messages[0].role': expected one of ...",
    type: 'invalid_request_error',
    code: 'invalid_parameter',
    param: 'messages[0].role',
  });
});

t.test('401 throws AuthenticationError with a null param', async (t) => {
  const error = (await failureOf(errorResponse(401, { type: 'authentication_error', code: 'invalid_api_key' }))) as AuthenticationError;
  t.type(error, AuthenticationError);
  t.equal(error.status, 401);
  t.equal(error.type, 'authentication_error');
  t.equal(error.code, 'invalid_api_key');
  t.equal(error.param, null);
});

t.test('404 throws NotFoundError', async (t) => {
  const error = (await failureOf(errorResponse(404, { type: 'not_found_error', code: 'request_not_found' }), 'get')) as NotFoundError;
  t.type(error, NotFoundError);
  t.equal(error.status, 404);
  t.equal(error.type, 'not_found_error');
  t.equal(error.code, 'request_not_found');
  t.equal(error.param, null);
});

t.test('422 throws UnprocessableEntityError naming idempotency_key', async (t) => {
  const error = (await failureOf(
    errorResponse(422, { type: 'idempotency_error', code: 'idempotency_key_reused', param: 'idempotency_key' }),
  )) as UnprocessableEntityError;
  t.type(error, UnprocessableEntityError);
  t.equal(error.status, 422);
  t.equal(error.type, 'idempotency_error');
  t.equal(error.code, 'idempotency_key_reused');
  t.equal(error.param, 'idempotency_key');
});

t.test('the other statuses choose their classes; the rest are plain APIErrors', async (t) => {
  const cases: [number, new (...args: never[]) => APIError][] = [
    [403, PermissionDeniedError],
    [409, ConflictError],
    [429, RateLimitError],
    [500, InternalServerError],
    [503, InternalServerError],
    [405, APIError],
    [413, APIError],
    [415, APIError],
  ];
  for (const [status, Class] of cases) {
    const error = (await failureOf(errorResponse(status, { type: 'some_type', code: 'some_code' }))) as APIError;
    t.type(error, Class, `${status} is a ${Class.name}`);
    t.equal(error.status, status);
    t.equal(error.code, 'some_code');
  }
  t.equal(APIError.generate(418, {}, undefined, new Headers()).constructor, APIError, '418: exactly APIError');
});

t.test('an error answer that is not the contract shape still gives its status, and nulls', async (t) => {
  const error = (await failureOf(new Response('<html>Bad Gateway</html>', { status: 502 }))) as InternalServerError;
  t.type(error, InternalServerError);
  t.equal(error.status, 502);
  t.equal(error.type, null);
  t.equal(error.code, null);
  t.equal(error.param, null);
  t.equal(error.message, '502 <html>Bad Gateway</html>');
});

t.test('an apiKey that fetch cannot send (a line break, NUL or non-Latin-1 inside) is refused by new Gateway, without showing it', async (t) => {
  // As `gateway keys create` prints them, the key and its secret on two lines, pasted into one variable.
  const pasted = `${API_KEY}\n${SECRET}`;
  for (const apiKey of [pasted, `${API_KEY}\r\nX: y`, `${API_KEY.slice(0, 20)}\0${API_KEY.slice(20)}`, `${API_KEY}\u200b`]) {
    let calls = 0;
    const error = await (async () => {
      const client = new Gateway({ apiKey, signingSecret: SECRET, baseURL: 'http://127.0.0.1:9', maxRetries: 2 });
      calls++;
      return client.requests.get('req_x');
    })().catch((caught: unknown) => caught);
    const shown = inspect(error);
    t.type(error, GatewayError, JSON.stringify(apiKey.slice(-12)));
    t.notOk(error instanceof APIError, 'not a connection error, retried: the key cannot be sent at all');
    t.equal(calls, 0, 'refused by new Gateway');
    t.notOk(shown.includes(API_KEY.slice(9)) || shown.includes(SECRET.slice(8)), 'neither the key nor the secret is in the error');
  }
  t.ok(new Gateway({ apiKey: `${API_KEY}\n`, signingSecret: SECRET }), 'a line break at the end is no part of the header (fetch trims it)');
});
