// requests.poll: looks a request up, backing off, until it is completed, failed or cancelled.
import t from 'tap';
import { APIUserAbortError, Gateway, GatewayError, NotFoundError } from '../../src/client/index.ts';
import { API_KEY, BASE_URL, SECRET, checkCall, completion, errorResponse, jsonResponse, record, recordPauses, scriptedFetch } from './support.ts';

function clientWith(script: Parameters<typeof scriptedFetch>[0]) {
  const { fetch, calls } = scriptedFetch(script);
  return { client: new Gateway({ apiKey: API_KEY, signingSecret: SECRET, baseURL: BASE_URL, fetch }), calls };
}

t.test('poll returns the completed record once the request is completed, after signed lookups', async (t) => {
  const pauses = recordPauses(t);
  const completed = record('completed', { attempts: 1, result: completion('the end') });
  const { client, calls } = clientWith([
    jsonResponse(200, record('queued')),
    jsonResponse(200, record('processing')),
    jsonResponse(200, record('retrying', { last_error_code: 'upstream_server_error' })),
    jsonResponse(200, completed),
  ]);

  const result = await client.requests.poll('req_0123456789abcdefghijklmn', { pollIntervalMs: 50 });

  t.same(result, completed);
  t.equal(result.status === 'completed' && result.result.choices[0]?.message.content, 'the end');
  t.equal(calls.length, 4);
  t.ok(calls.every((call) => call.method === 'GET' && new URL(call.url).pathname === '/v1/requests/req_0123456789abcdefghijklmn'));
  t.ok(calls.every((call) => checkCall(call).valid), 'every lookup is signed');
  // 50, 100 and 200 ms, each less up to a fifth at random.
  t.equal(pauses.length, 3, 'a pause between lookups');
  t.ok(
    [50, 100, 200].every((ms, index) => pauses[index]! >= ms * 0.8 && pauses[index]! <= ms),
    `pauses grow: ${pauses.map(Math.round).join(', ')} ms`,
  );
});

t.test('poll returns a failed record too: failed is final', async (t) => {
  const failed = record('failed', { attempts: 5, last_error_code: 'upstream_bad_request' });
  const { client, calls } = clientWith([jsonResponse(200, record('processing')), jsonResponse(200, failed)]);
  const result = await client.requests.poll('req_0123456789abcdefghijklmn', { pollIntervalMs: 10 });
  t.same(result, failed);
  t.equal(calls.length, 2);
});

t.test('poll returns a cancelled record too: cancelled is final', async (t) => {
  const cancelled = record('cancelled', { attempts: 1, last_error_code: 'upstream_timeout' });
  const { client, calls } = clientWith([jsonResponse(200, record('retrying')), jsonResponse(200, cancelled), jsonResponse(200, record('queued'))]);
  const result = await client.requests.poll('req_0123456789abcdefghijklmn', { pollIntervalMs: 10 });
  t.same(result, cancelled);
  t.equal(result.status, 'cancelled');
  t.equal(calls.length, 2, 'no lookup after the cancelled record');
});

t.test('poll of an unknown id throws NotFoundError at once', async (t) => {
  const { client, calls } = clientWith([errorResponse(404, { type: 'not_found_error', code: 'request_not_found' })]);
  await t.rejects(client.requests.poll('req_unknown'), NotFoundError);
  t.equal(calls.length, 1);
});

t.test('poll stops with APIUserAbortError when its signal fires between lookups', async (t) => {
  const controller = new AbortController();
  // The second pause never ends by itself: the signal, fired once it has begun, ends it.
  const pauses = recordPauses(t, (_ms, index) => {
    if (index === 0) return 'now';
    setImmediate(() => controller.abort());
    return 'never';
  });
  const { client, calls } = clientWith([jsonResponse(200, record('processing'))]);
  await t.rejects(client.requests.poll('req_x', { pollIntervalMs: 100, signal: controller.signal }), APIUserAbortError);
  t.equal(pauses.length, 2);
  t.equal(calls.length, 2, 'two lookups, and none after the abort');
});

t.test('a pause longer than a timer keeps (above 2^31 - 1 ms), or not a number, is refused with a GatewayError, not a tight loop', async (t) => {
  for (const option of ['pollIntervalMs', 'maxPollIntervalMs']) {
    for (const pause of [2 ** 31, 2 ** 32, NaN, -1, 0.5]) {
      const { client, calls } = clientWith([jsonResponse(200, record('queued'))]);
      // Bounds the polling, should the pause be taken rather than refused.
      const signal = AbortSignal.timeout(200);
      const error = await client.requests.poll('req_x', { [option]: pause, signal }).catch((caught: unknown) => caught);
      t.type(error, GatewayError, `${option} ${pause}`);
      t.match((error as Error).message, new RegExp(`^${option} must be a whole number of milliseconds from 0 to 2147483647\\.$`), `${option} ${pause}`);
      t.equal(calls.length, 0, `${option} ${pause}: no lookup`);
    }
  }
});

t.test('maxPollIntervalMs bounds every pause, the first too, when it is below pollIntervalMs', async (t) => {
  const { client, calls } = clientWith([
    jsonResponse(200, record('queued')),
    jsonResponse(200, record('processing')),
    jsonResponse(200, record('processing')),
    jsonResponse(200, record('completed', { result: completion() })),
  ]);
  const pauses = recordPauses(t);
  const result = await client.requests.poll('req_0123456789abcdefghijklmn', { pollIntervalMs: 1_000, maxPollIntervalMs: 20 });
  t.equal(result.status, 'completed');
  t.equal(calls.length, 4);
  t.equal(pauses.length, 3);
  t.ok(pauses.every((ms) => ms >= 16 && ms <= 20), `three pauses of at most 20 ms (${pauses.map(Math.round).join(', ')} ms), not of 1 s`);
});
