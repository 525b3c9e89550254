// Retries, timeouts and aborts, with an injected fetch that scripts each answer.
import t from 'tap';
import {
  APIConnectionError,
  APIConnectionTimeoutError,
  APIUserAbortError,
  Gateway,
  GatewayError,
  InternalServerError,
  RateLimitError,
  type GatewayOptions,
} from '../../src/client/index.ts';
import { parseRetryAfter, retryAfterMs, sleep } from '../../src/client/retry.ts';
import {
  API_KEY,
  BASE_URL,
  SECRET,
  checkCall,
  completion,
  errorResponse,
  jsonResponse,
  recordPauses,
  scriptedFetch,
  type Scripted,
} from './support.ts';

const params = { model: 'test-echo', messages: [{ role: 'user' as const, content: 'hi' }], wait: true };
const unavailable = (headers: Record<string, string> = {}) =>
  errorResponse(503, { type: 'api_error', code: 'service_unavailable' }, headers);

function clientWith(script: Scripted[], options: Partial<GatewayOptions> = {}) {
  const scripted = scriptedFetch(script);
  const client = new Gateway({ apiKey: API_KEY, signingSecret: SECRET, baseURL: BASE_URL, fetch: scripted.fetch, ...options });
  return { client, calls: scripted.calls };
}

t.test('a 503 is retried with the same idempotency key and a new, valid signature each time', async (t) => {
  const { client, calls } = clientWith([unavailable({ 'retry-after': '0' }), unavailable({ 'retry-after': '0' }), jsonResponse(200, completion('done'))]);

  const result = await client.chat.completions.create(params);

  t.equal(result.object, 'chat.completion');
  t.equal(calls.length, 3);
  const keys = calls.map((call) => call.json.idempotency_key);
  t.match(keys[0], /^[\x20-\x7e]{1,255}$/, 'a key was generated');
  t.same(new Set(keys).size, 1, 'every attempt carries the same idempotency key');
  t.same(new Set(calls.map((call) => call.body)).size, 1, 'every attempt sends the same bytes');
  const signatures = calls.map((call) => checkCall(call));
  t.ok(signatures.every((signature) => signature.valid), 'every attempt is validly signed');
  t.equal(new Set(signatures.map((signature) => signature.nonce)).size, 3, 'every attempt has a nonce of its own');
});

t.test('a dropped connection (fetch rejects with TypeError) is retried with the same key and a new nonce', async (t) => {
  const { client, calls } = clientWith(['drop', jsonResponse(202, { id: 'req_x', object: 'chat.completion.async', status: 'queued', created: 1 })]);

  const result = await client.chat.completions.create({ ...params, wait: false });

  t.same(result, { id: 'req_x', object: 'chat.completion.async', status: 'queued', created: 1 });
  t.equal(calls.length, 2);
  t.equal(calls[1]!.json.idempotency_key, calls[0]!.json.idempotency_key);
  t.not(checkCall(calls[1]!).nonce, checkCall(calls[0]!).nonce);
  t.ok(checkCall(calls[1]!).valid);
});

t.test('a caller-chosen idempotency key is sent as is on every attempt', async (t) => {
  const { client, calls } = clientWith(['drop', jsonResponse(200, completion())]);
  await client.chat.completions.create({ ...params, idempotency_key: 'order-42' });
  t.same(calls.map((call) => call.json.idempotency_key), ['order-42', 'order-42']);
});

t.test('two create calls get two different generated idempotency keys', async (t) => {
  const { client, calls } = clientWith([jsonResponse(200, completion())]);
  await client.chat.completions.create(params);
  await client.chat.completions.create(params);
  t.not(calls[0]!.json.idempotency_key, calls[1]!.json.idempotency_key);
});

t.test('408, 409, 429 and 500 are retried', async (t) => {
  for (const status of [408, 409, 429, 500]) {
    const { client, calls } = clientWith([
      errorResponse(status, { type: 'api_error', code: 'x' }, { 'retry-after': '0' }),
      jsonResponse(200, completion()),
    ]);
    const result = await client.chat.completions.create(params);
    t.equal(result.object, 'chat.completion', `${status}: answered after a retry`);
    t.equal(calls.length, 2, `${status}: two attempts`);
  }
});

t.test('a 409 request_already_finished is not retried, whatever the call, while other 409s are', async (t) => {
  const finished = () => errorResponse(409, { type: 'invalid_request_error', code: 'request_already_finished' }, { 'retry-after': '0' });
  const { client, calls } = clientWith([finished(), jsonResponse(200, completion())]);
  const error = await client.chat.completions.create(params).catch((caught: unknown) => caught);
  t.equal((error as { code?: string }).code, 'request_already_finished');
  t.equal(calls.length, 1, 'one attempt only');

  const other = clientWith([errorResponse(409, { type: 'api_error', code: 'lock_timeout' }, { 'retry-after': '0' }), jsonResponse(200, completion())]);
  await other.client.chat.completions.create(params);
  t.equal(other.calls.length, 2, 'a 409 with another code is retried');

  const bodiless = clientWith([new Response('', { status: 409, headers: { 'retry-after': '0' } }), jsonResponse(200, completion())]);
  await bodiless.client.chat.completions.create(params);
  t.equal(bodiless.calls.length, 2, 'a 409 without an error body is retried');
});

t.test('400, 401, 403, 404, 413 and 422 are not retried', async (t) => {
  for (const status of [400, 401, 403, 404, 413, 422]) {
    const { client, calls } = clientWith([errorResponse(status, { type: 't', code: 'c' }), jsonResponse(200, completion())]);
    const error = await client.chat.completions.create(params).catch((caught: unknown) => caught);
    t.equal((error as { status?: number }).status, status, `${status} is thrown`);
    t.equal(calls.length, 1, `${status}: one attempt only`);
  }
});

t.test('after maxRetries retries the last error is thrown, with its status and code', async (t) => {
  const { client, calls } = clientWith([unavailable({ 'retry-after': '0' })], { maxRetries: 3 });
  const error = await client.chat.completions.create(params).catch((caught: unknown) => caught);
  t.type(error, InternalServerError);
  t.equal((error as InternalServerError).status, 503);
  t.equal((error as InternalServerError).code, 'service_unavailable');
  t.equal(calls.length, 4, 'the first attempt and three retries');

  const once = clientWith([unavailable()]);
  await t.rejects(once.client.requests.get('req_x', { maxRetries: 0 }), InternalServerError);
  t.equal(once.calls.length, 1, 'maxRetries 0 in the call options: no retry');
});

t.test('retry-after in seconds is waited out before the retry', async (t) => {
  const pauses = recordPauses(t);
  const { client, calls } = clientWith([
    errorResponse(429, { type: 'rate_limit_error', code: 'rate_limit_exceeded' }, { 'retry-after': '1' }),
    jsonResponse(200, completion()),
  ]);
  await client.chat.completions.create(params);
  t.equal(calls.length, 2);
  t.same(pauses, [1_000], 'one pause before the retry: the second asked for');
});

t.test('retry-after as an HTTP date, and retry-after-ms, are honoured', async (t) => {
  const pauses = recordPauses(t);
  const date = new Date(Date.now() + 30_000).toUTCString(); // whole seconds: 29 to 30 s from now
  const byDate = clientWith([unavailable({ 'retry-after': date }), jsonResponse(200, completion())]);
  const before = Date.now();
  await byDate.client.chat.completions.create(params);
  const after = Date.now();
  t.equal(byDate.calls.length, 2);
  t.equal(pauses.length, 1);
  // The time until the date when the answer was read, which was between `before` and `after`.
  const [untilDate] = pauses;
  t.ok(untilDate! >= Date.parse(date) - after && untilDate! <= Date.parse(date) - before, `paused ${untilDate} ms, until the date`);

  const byMs = clientWith([unavailable({ 'retry-after-ms': '700', 'retry-after': '30' }), jsonResponse(200, completion())]);
  await byMs.client.chat.completions.create(params);
  t.equal(byMs.calls.length, 2);
  t.same(pauses.slice(1), [700], 'retry-after-ms wins');
});

t.test('retry-after is read as seconds or an HTTP date, in whole milliseconds, by the client and the gateway alike', async (t) => {
  const now = Date.parse('Wed, 21 Oct 2015 07:28:00 GMT');
  t.equal(parseRetryAfter('2', now), 2_000);
  t.equal(parseRetryAfter(' 1.5 ', now), 1_500, 'a fraction of a second, spaces around');
  t.equal(parseRetryAfter('0.0004', now), 0, 'rounded to whole milliseconds');
  t.equal(parseRetryAfter('Wed, 21 Oct 2015 07:28:03 GMT', now), 3_000, 'an HTTP date: the time until it');
  t.equal(parseRetryAfter('Wed, 21 Oct 2015 07:27:00 GMT', now), 0, 'a date already past: no wait');
  t.equal(parseRetryAfter('-1', now), undefined, 'a negative number is unreadable');
  t.equal(parseRetryAfter('soon', now), undefined);
  t.equal(parseRetryAfter('  ', now), undefined);
  t.equal(parseRetryAfter(null, now), undefined);
  t.equal(retryAfterMs(new Headers({ 'retry-after': '3' }), now), 3_000);
  t.equal(retryAfterMs(new Headers({ 'retry-after-ms': '250.5', 'retry-after': '3' }), now), 250.5, 'retry-after-ms first');
  t.equal(retryAfterMs(new Headers({ 'retry-after-ms': 'x', 'retry-after': '-1' }), now), undefined);
});

t.test('without retry-after the retries back off exponentially, with jitter', async (t) => {
  const pauses = recordPauses(t);
  const { client, calls } = clientWith(['drop', 'drop', jsonResponse(200, completion())]);
  await client.chat.completions.create(params);
  t.equal(calls.length, 3);
  t.equal(pauses.length, 2, 'a pause before each retry');
  const [first, second] = pauses;
  t.ok(first! >= 375 && first! <= 500, `first pause ${Math.round(first!)} ms (500 ms, less up to a quarter)`);
  t.ok(second! >= 750 && second! <= 1_000, `second pause ${Math.round(second!)} ms (1 s, less up to a quarter)`);
});

t.test('a retry-after beyond a minute is not waited out: the error is thrown at once', async (t) => {
  const pauses = recordPauses(t);
  const { client, calls } = clientWith([
    errorResponse(429, { type: 'rate_limit_error', code: 'rate_limit_exceeded' }, { 'retry-after': '3600' }),
  ]);
  const error = await client.chat.completions.create(params).catch((caught: unknown) => caught);
  t.type(error, RateLimitError);
  t.equal((error as RateLimitError).headers?.get('retry-after'), '3600', 'the caller can read the wait asked for');
  t.equal(calls.length, 1);
  t.same(pauses, [], 'no pause taken');
});

t.test('an attempt that gets no answer within the timeout throws APIConnectionTimeoutError', async (t) => {
  const { client, calls } = clientWith(['hang'], { maxRetries: 0 });
  const started = performance.now();
  const error = await client.chat.completions.create(params, { timeout: 200 }).catch((caught: unknown) => caught);
  const elapsed = performance.now() - started;
  t.type(error, APIConnectionTimeoutError);
  t.type(error, APIConnectionError, 'a timeout is a kind of connection error');
  t.equal((error as APIConnectionTimeoutError).status, undefined);
  // The fetch never answers, and the client's default timeout is 2 minutes: the error at all is
  // the 200 ms timeout, which the message names.
  t.match((error as APIConnectionTimeoutError).message, /after 200 ms/);
  t.ok(elapsed >= 190, `gave up after ${Math.round(elapsed)} ms, not before the timeout`);
  t.equal(calls.length, 1);
  t.equal(calls[0]!.signal?.aborted, true, 'the fetch was told to stop');
});

t.test('a timeout longer than a timer keeps (above 2^31 - 1 ms) is refused with a GatewayError, not an attempt ended after 1 ms', async (t) => {
  const refused = /^timeout must be a whole number of milliseconds from 0 to 2147483647\.$/;
  for (const timeout of [2 ** 31, 2 ** 53, Infinity, NaN, -1, 1.5]) {
    const error = (() => {
      try {
        return new Gateway({ apiKey: API_KEY, signingSecret: SECRET, timeout });
      } catch (caught) {
        return caught;
      }
    })();
    t.type(error, GatewayError, `new Gateway with timeout ${timeout}`);
    t.match((error as Error).message, refused, `timeout ${timeout}`);
  }

  let calls = 0;
  const slowFetch = async () => {
    calls++;
    await new Promise((resolve) => setTimeout(resolve, 50));
    return jsonResponse(200, completion('in time'));
  };
  const client = new Gateway({ apiKey: API_KEY, signingSecret: SECRET, baseURL: BASE_URL, fetch: slowFetch, timeout: 2 ** 31 - 1, maxRetries: 0 });
  const result = await client.chat.completions.create(params);
  t.equal(result.object === 'chat.completion' && result.choices[0]?.message.content, 'in time', 'the longest timeout a timer keeps waits');
  const perCall = await client.chat.completions.create(params, { timeout: 2 ** 31 }).catch((caught: unknown) => caught);
  t.match((perCall as Error).message, refused, 'a call\'s own timeout is checked too');
  t.equal(calls, 1, 'and nothing is sent with it');

  await t.rejects(sleep(2 ** 31, undefined), RangeError, 'a wait the timer would cut to 1 ms is refused');
  await t.rejects(sleep(NaN, undefined), RangeError);
});

t.test('a timed-out attempt is retried under the same idempotency key', async (t) => {
  const { client, calls } = clientWith(['hang', jsonResponse(200, completion('second time'))], { timeout: 150 });
  const result = await client.chat.completions.create(params);
  t.equal(result.object === 'chat.completion' && result.choices[0]?.message.content, 'second time');
  t.equal(calls.length, 2);
  t.equal(calls[1]!.json.idempotency_key, calls[0]!.json.idempotency_key);
});

t.test('the default timeout comfortably exceeds the server’s 30 s default wait', async (t) => {
  const client = new Gateway({ apiKey: API_KEY, signingSecret: SECRET });
  t.ok(client.timeout >= 60_000, `default timeout ${client.timeout} ms`);
  t.equal(client.baseURL, 'http://localhost:8080');
  t.equal(client.maxRetries, 2);
});

t.test('aborting the signal stops a call in flight with APIUserAbortError, without a retry', async (t) => {
  const { client, calls } = clientWith(['hang']);
  const controller = new AbortController();
  setTimeout(() => controller.abort(new Error('user gave up')), 100);
  // The fetch never answers, and the client's timeout is 2 minutes: only the signal ends the call.
  const error = await client.chat.completions.create(params, { signal: controller.signal }).catch((caught: unknown) => caught);
  t.type(error, APIUserAbortError);
  t.equal(((error as APIUserAbortError).cause as Error).message, 'user gave up');
  t.equal(calls[0]!.signal?.aborted, true, 'the fetch was told to stop');
  t.equal(calls.length, 1);
});

t.test('aborting during the wait before a retry stops at once', async (t) => {
  const controller = new AbortController();
  // The pause never ends by itself: only the signal, fired once the pause has begun, ends it.
  const pauses = recordPauses(t, () => {
    setImmediate(() => controller.abort());
    return 'never';
  });
  const { client, calls } = clientWith([unavailable({ 'retry-after': '30' })]);
  await t.rejects(client.chat.completions.create(params, { signal: controller.signal }), APIUserAbortError);
  t.same(pauses, [30_000], 'during the 30 s pause asked for');
  t.equal(calls.length, 1, 'no retry');
});

t.test('an already aborted signal sends nothing', async (t) => {
  const { client, calls } = clientWith([jsonResponse(200, completion())]);
  await t.rejects(client.requests.get('req_x', { signal: AbortSignal.abort() }), APIUserAbortError);
  t.equal(calls.length, 0);
});
