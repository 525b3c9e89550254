// Live mode against a real OpenAI-compatible server on loopback: each upstream answer ends in
// its state and attempt error code. The requests here are alone on their lane: a first failure
// is charged (nothing says the provider is down), and later ones are not (nothing says it is up).
import http from 'node:http';
import zlib from 'node:zlib';
import t, { type Test } from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { freePort, listenOnLoopback } from '../helpers/ports.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { attemptRows, isTerminal, requestRow, waitForRow } from '../helpers/rows.ts';
import { completionFor, startFakeUpstream, type Reply } from '../helpers/upstream.ts';

const MAX_ATTEMPTS = 3;

async function runAgainst(t: Test, reply: (count: number) => Reply, env: Record<string, string> = {}) {
  const upstream = await startFakeUpstream(t, (call) => reply(call.count));
  const gateway = await startTestGateway(t, {
    env: { UPSTREAM_BASE_URL: upstream.baseUrl, MAX_ATTEMPTS: String(MAX_ATTEMPTS), UPSTREAM_TIMEOUT_MS: '300', ...env },
  });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const accepted = await client.post({ model: 'gpt-test', messages: userMessage() });
  const row = await waitForRow(gateway.db, accepted.body.id, isTerminal);
  return { gateway, upstream, row, attempts: await attemptRows(gateway.db, row.id) };
}

t.test('200 with a chat completion: completed after one attempt, the result stored verbatim', async (t) => {
  const text = `{"object":"chat.completion", "id":"chatcmpl-1",  "choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"x":1.50}`;
  const { gateway, row, attempts } = await runAgainst(t, () => ({ status: 200, text }));
  t.equal(row.status, 'completed');
  t.equal(row.attempts, 1);
  t.equal(row.last_error_code, null);
  t.ok(row.finished_at);
  const { rows } = await gateway.pool.query('select result::text as result from gateway.requests where id = $1', [row.id]);
  t.equal(rows[0].result, text, 'byte for byte what the upstream sent');
  t.equal(attempts.length, 1);
  t.match(attempts[0], { attempt_number: 1, outcome: 'succeeded', upstream_status: 200, error_code: null });
  t.ok((attempts[0]!.duration_ms ?? -1) >= 0);
});

for (const [status, code] of [
  [400, 'upstream_bad_request'],
  [404, 'upstream_bad_request'],
  [413, 'upstream_bad_request'],
  [422, 'upstream_bad_request'],
] as const) {
  t.test(`${status}: failed with ${code} after one attempt, not retried`, async (t) => {
    const { row, attempts, upstream } = await runAgainst(t, () => ({ status, json: { error: { message: 'no' } } }));
    t.equal(row.status, 'failed');
    t.equal(row.attempts, 1);
    t.equal(row.last_error_code, code);
    t.equal(upstream.calls.length, 1);
    t.match(attempts, [{ outcome: 'failed', error_code: code, upstream_status: status }]);
  });
}

for (const [name, reply, code, upstreamStatus] of [
  ['500', { status: 500 }, 'upstream_server_error', 500],
  ['502', { status: 502 }, 'upstream_server_error', 502],
  ['503', { status: 503 }, 'upstream_server_error', 503],
  ['408', { status: 408 }, 'upstream_server_error', 408],
  ['409', { status: 409 }, 'upstream_server_error', 409],
  ['401', { status: 401 }, 'upstream_auth_error', 401],
  ['403', { status: 403 }, 'upstream_auth_error', 403],
  ['301', { status: 301, headers: { location: 'http://127.0.0.1:1/v1/chat/completions' } }, 'upstream_invalid_response', 301],
  ['a status above 599 (600)', { status: 600 }, 'upstream_invalid_response', 600],
  ['a status above 599 (999)', { status: 999 }, 'upstream_invalid_response', 999],
  ['200 with a body that is not JSON', { status: 200, text: 'this is not JSON' }, 'upstream_invalid_response', 200],
  ['200 with a JSON object that is no chat completion', { status: 200, json: { hello: 'world' } }, 'upstream_invalid_response', 200],
  ['200 with a JSON array', { status: 200, json: [1, 2] }, 'upstream_invalid_response', 200],
  ['200 with a chat completion without an id', { status: 200, json: { object: 'chat.completion', choices: [] } }, 'upstream_invalid_response', 200],
  ['an upstream that never answers', { hang: true }, 'upstream_timeout', null],
  ['a connection reset', { reset: true }, 'upstream_connection_error', null],
] as const) {
  t.test(`${name}: ${code}, charged, and retried (it fails once MAX_ATTEMPTS are charged)`, async (t) => {
    const { row, attempts, upstream } = await runAgainst(t, () => reply as Reply, { MAX_ATTEMPTS: '1' });
    t.match(row, { status: 'failed', attempts: 1, charged_attempts: 1, last_error_code: code });
    t.equal(upstream.calls.length, 1);
    t.same(
      attempts.map((attempt) => [attempt.attempt_number, attempt.outcome, attempt.error_code, attempt.upstream_status, attempt.charged]),
      [[1, 'failed', code, upstreamStatus, true]],
    );
  });
}

t.test('a request failing alone is charged once, then retried uncharged: it completes after more attempts than MAX_ATTEMPTS', async (t) => {
  const { row, attempts } = await runAgainst(t, (count) =>
    count <= MAX_ATTEMPTS + 1 ? { status: 503 } : { status: 200, json: completionFor({ messages: [{ content: 'x' }] }) },
  );
  t.match(row, { status: 'completed', attempts: MAX_ATTEMPTS + 2, charged_attempts: 1, last_error_code: 'upstream_server_error' });
  t.same(
    attempts.map((attempt) => attempt.charged),
    [true, ...Array.from({ length: MAX_ATTEMPTS }, () => false), null],
    'nothing succeeded between its attempts: the provider may be down, not the request at fault',
  );
});

t.test('429s are retried without being charged: more of them than MAX_ATTEMPTS, then a completion', async (t) => {
  const { row, attempts } = await runAgainst(t, (count) =>
    count <= MAX_ATTEMPTS + 2 ? { status: 429 } : { status: 200, json: completionFor({ messages: [{ content: 'x' }] }) },
  );
  t.match(row, { status: 'completed', attempts: MAX_ATTEMPTS + 3, charged_attempts: 0, last_error_code: 'upstream_rate_limited' });
  t.same(
    attempts.map((attempt) => [attempt.outcome, attempt.error_code, attempt.charged]),
    [...Array.from({ length: MAX_ATTEMPTS + 2 }, () => ['failed', 'upstream_rate_limited', false]), ['succeeded', null, null]],
  );
});

t.test('connection refused: upstream_connection_error', async (t) => {
  const closedPort = await freePort();
  const gateway = await startTestGateway(t, {
    env: { UPSTREAM_BASE_URL: `http://127.0.0.1:${closedPort}/v1`, MAX_ATTEMPTS: '1' },
  });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const accepted = await client.post({ model: 'gpt-test', messages: userMessage() });
  const row = await waitForRow(gateway.db, accepted.body.id, isTerminal);
  t.match(row, { status: 'failed', attempts: 1, last_error_code: 'upstream_connection_error' });
  const attempts = await attemptRows(gateway.db, row.id);
  t.match(attempts[0], { error_code: 'upstream_connection_error', error_detail: /ECONNREFUSED/ });
});

t.test('a failure then a success: completed, and last_error_code keeps the failure', async (t) => {
  const { row, attempts } = await runAgainst(t, (count) =>
    count === 1 ? { status: 500 } : { status: 200, json: completionFor({ messages: [{ content: 'x' }] }) },
  );
  t.match(row, { status: 'completed', attempts: 2, last_error_code: 'upstream_server_error' });
  t.same(attempts.map((attempt) => attempt.outcome), ['failed', 'succeeded']);
});

t.test('a retry-after longer than the backoff is honoured', async (t) => {
  const { row, attempts } = await runAgainst(t, (count) =>
    count === 1
      ? { status: 429, headers: { 'retry-after': '1' } }
      : { status: 200, json: completionFor({ messages: [{ content: 'x' }] }) },
  );
  t.match(row, { status: 'completed', attempts: 2, last_error_code: 'upstream_rate_limited' });
  const gap = attempts[1]!.started_at.getTime() - attempts[0]!.finished_at!.getTime();
  t.ok(gap >= 950, `the second attempt started ${gap} ms after the first ended (retry-after: 1 s, backoff cap 40 ms)`);
});

t.test('a retry-after of 1e308 pauses the lane for an hour at most, and the request waits for it', async (t) => {
  const upstream = await startFakeUpstream(t, () => ({ status: 429, headers: { 'retry-after': '1e308' } }));
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const accepted = await client.post({ model: 'gpt-test', messages: userMessage() });
  const row = await waitForRow(gateway.db, accepted.body.id, (request) => request.status === 'retrying');
  t.match(row, { attempts: 1, charged_attempts: 0, last_error_code: 'upstream_rate_limited' });
  const { rows } = await gateway.pool.query(
    `select extract(epoch from paused_until - now()) as paused_for from gateway.lanes where upstream = 'default'`,
  );
  const pausedFor = Number(rows[0].paused_for);
  t.ok(pausedFor > 3_500 && pausedFor <= 3_600, `the lane paused for ${pausedFor.toFixed(0)} s: the hour of the cap, not forever`);
  const waitFor = (row.next_attempt_at!.getTime() - Date.now()) / 1000;
  t.ok(waitFor > 3_500 && waitFor <= 3_600, `and the request's next attempt is ${waitFor.toFixed(0)} s away`);
  t.equal(upstream.calls.length, 1);
});

t.test('the upstream receives the stored body and the upstream key, never our own fields', async (t) => {
  const { upstream, gateway, row } = await runAgainst(t, () => ({ status: 200, json: completionFor({}) }), {
    UPSTREAM_API_KEY: 'sk-upstream-test-key',
  });
  t.equal(upstream.calls.length, 1);
  const call = upstream.calls[0]!;
  t.equal(call.headers.authorization, 'Bearer sk-upstream-test-key');
  t.match(call.headers['content-type'], /^application\/json/);
  t.same(call.body, { model: 'gpt-test', messages: userMessage() });
  const stored = await requestRow(gateway.db, row.id);
  t.same(stored?.body, call.body);
  t.notOk(gateway.logs.some((line) => line.includes('sk-upstream-test-key')), 'the upstream key is not logged');
});

t.test('a 2xx answer of 20 MiB: upstream_invalid_response past UPSTREAM_MAX_RESPONSE_BYTES (2 MiB), read no further', async (t) => {
  const total = 20 * 1024 * 1024;
  const chunk = Buffer.alloc(256 * 1024, 'x');
  let sent = 0;
  let whole = false;
  let answerClosed: () => void = () => {};
  const closed = new Promise<void>((resolve) => (answerClosed = resolve));
  // Sent a chunk at a time, as fast as the gateway reads it: it must stop reading (and close the
  // connection) once past its limit, long before the end.
  const upstream = http.createServer(async (request, response) => {
    for await (const _ of request);
    response.on('close', answerClosed);
    response.writeHead(200, { 'content-type': 'application/json' });
    response.write('{"object":"chat.completion","id":"chatcmpl-1","choices":[],"padding":"');
    while (sent < total && !response.destroyed) {
      if (!response.write(chunk)) await new Promise((drained) => response.once('drain', drained).once('close', drained));
      sent += chunk.byteLength;
      await new Promise((next) => setTimeout(next, 2));
    }
    if (!response.destroyed) {
      whole = true;
      response.end('"}');
    }
  });
  const upstreamPort = await listenOnLoopback(t, upstream);
  const gateway = await startTestGateway(t, {
    env: { UPSTREAM_BASE_URL: `http://127.0.0.1:${upstreamPort}/v1`, MAX_ATTEMPTS: '1', UPSTREAM_TIMEOUT_MS: '20000' },
  });
  t.equal(gateway.config.upstreamMaxResponseBytes, 2 * 1024 * 1024, 'the default limit');
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const accepted = await client.post({ model: 'gpt-test', messages: userMessage() });
  const row = await waitForRow(gateway.db, accepted.body.id, isTerminal, 20_000);
  const attempts = await attemptRows(gateway.db, row.id);
  t.match(row, { status: 'failed', attempts: 1, last_error_code: 'upstream_invalid_response' });
  t.match(attempts[0], { upstream_status: 200, error_detail: 'the 2xx body is larger than 2097152 bytes' });
  await closed;
  t.notOk(whole, `the gateway closed the connection after ${(sent / 1024 / 1024).toFixed(2)} MiB of 20 MiB`);
  t.ok(sent < total / 2, 'long before the end');
});

t.test('a 2xx answer that says it is larger than the limit (content-length) is not read at all', async (t) => {
  // The headers and the body's first bytes, the rest held back for good: only the content-length
  // can end this attempt before the upstream timeout (reading the body would wait for it, and end
  // as upstream_timeout).
  const { row, attempts } = await runAgainst(
    t,
    () => ({ status: 200, text: '{"object":"chat.completion",', headers: { 'content-length': String(3 * 1024 * 1024) }, partial: 'hold' }),
    { MAX_ATTEMPTS: '1', UPSTREAM_TIMEOUT_MS: '5000' },
  );
  t.match(row, { status: 'failed', attempts: 1, last_error_code: 'upstream_invalid_response' }, 'failed on its content-length, not at the upstream timeout');
  t.match(attempts[0], { upstream_status: 200, error_code: 'upstream_invalid_response', error_detail: 'the 2xx body is larger than 2097152 bytes' });
});

t.test('UPSTREAM_MAX_RESPONSE_BYTES sets the limit', async (t) => {
  const text = JSON.stringify({ ...completionFor({ model: 'gpt-test', messages: userMessage() }), padding: 'x'.repeat(4000) });
  const { row, attempts } = await runAgainst(t, () => ({ status: 200, text }), { MAX_ATTEMPTS: '1', UPSTREAM_MAX_RESPONSE_BYTES: '4096' });
  t.match(row, { status: 'failed', last_error_code: 'upstream_invalid_response' });
  t.match(attempts[0], { error_detail: 'the 2xx body is larger than 4096 bytes' });
  const small = await runAgainst(t, () => ({ status: 200, text }), { MAX_ATTEMPTS: '1', UPSTREAM_MAX_RESPONSE_BYTES: '8192' });
  t.match(small.row, { status: 'completed' }, 'and one within it completes');
});

/** A live gateway whose upstream answers every call 200 with these headers and body (bytes as given). */
async function answeredWith(t: Test, headers: Record<string, string>, body: Buffer | (() => AsyncIterable<Buffer>), env: Record<string, string> = {}) {
  const server = http.createServer(async (request, response) => {
    for await (const _ of request);
    response.writeHead(200, { 'content-type': 'application/json', ...headers });
    if (Buffer.isBuffer(body)) return response.end(body);
    for await (const chunk of body()) {
      if (response.destroyed) return;
      if (!response.write(chunk)) await new Promise((drained) => response.once('drain', drained).once('close', drained));
    }
    response.end();
  });
  const port = await listenOnLoopback(t, server);
  const gateway = await startTestGateway(t, {
    env: { UPSTREAM_BASE_URL: `http://127.0.0.1:${port}/v1`, MAX_ATTEMPTS: '1', UPSTREAM_TIMEOUT_MS: '20000', ...env },
  });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const accepted = await client.post({ model: 'gpt-test', messages: userMessage() });
  const row = await waitForRow(gateway.db, accepted.body.id, isTerminal, 20_000);
  return { gateway, row, attempts: await attemptRows(gateway.db, row.id) };
}

for (const [coding, encode] of [
  ['gzip', zlib.gzipSync],
  ['x-gzip', zlib.gzipSync],
  ['deflate', zlib.deflateSync],
  ['br', zlib.brotliCompressSync],
  ['zstd', zlib.zstdCompressSync],
  ['gzip, br', (text: Buffer) => zlib.brotliCompressSync(zlib.gzipSync(text))],
] as const) {
  t.test(`a completion with content-encoding ${coding} is decoded: completed, the JSON text stored`, async (t) => {
    const text = JSON.stringify(completionFor({ model: 'gpt-test', messages: userMessage() }));
    const { gateway, row, attempts } = await answeredWith(t, { 'content-encoding': coding }, encode(Buffer.from(text)));
    t.match(row, { status: 'completed', attempts: 1, last_error_code: null });
    t.match(attempts, [{ outcome: 'succeeded', upstream_status: 200 }]);
    const { rows } = await gateway.pool.query('select result::text as result from gateway.requests where id = $1', [row.id]);
    t.equal(rows[0].result, text);
  });
}

t.test('a compressed answer that inflates past UPSTREAM_MAX_RESPONSE_BYTES (a bomb) is upstream_invalid_response, read no further', async (t) => {
  // 256 KB of gzip that would inflate to 256 MiB, with a content-length well under the limit.
  const gzip = zlib.createGzip({ level: 9 });
  const compressed: Buffer[] = [];
  gzip.on('data', (chunk: Buffer) => compressed.push(chunk));
  const ended = new Promise((resolve) => gzip.on('end', resolve));
  gzip.write('{"object":"chat.completion","id":"chatcmpl-1","choices":[],"padding":"');
  const spaces = Buffer.alloc(1024 * 1024, ' ');
  for (let i = 0; i < 256; i++) gzip.write(spaces);
  gzip.end('"}');
  await ended;
  const bomb = Buffer.concat(compressed);
  const { row, attempts } = await answeredWith(t, { 'content-encoding': 'gzip', 'content-length': String(bomb.byteLength) }, bomb);
  t.match(row, { status: 'failed', attempts: 1, last_error_code: 'upstream_invalid_response' });
  t.match(attempts, [{ upstream_status: 200, error_detail: 'the 2xx body is larger than 2097152 bytes' }]);
});

t.test('a gzip answer whose connection is reset mid-body: upstream_connection_error, not an invalid answer', async (t) => {
  const gzipped = zlib.gzipSync(JSON.stringify({ ...completionFor({ messages: [{ content: 'x' }] }), padding: 'x'.repeat(100_000) }));
  const server = http.createServer(async (request, response) => {
    for await (const _ of request);
    response.writeHead(200, { 'content-type': 'application/json', 'content-encoding': 'gzip', 'content-length': String(gzipped.byteLength) });
    response.write(gzipped.subarray(0, gzipped.byteLength / 2), () => setTimeout(() => response.socket?.resetAndDestroy(), 20));
  });
  const port = await listenOnLoopback(t, server);
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: `http://127.0.0.1:${port}/v1`, MAX_ATTEMPTS: '1' } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const accepted = await client.post({ model: 'gpt-test', messages: userMessage() });
  const row = await waitForRow(gateway.db, accepted.body.id, isTerminal);
  t.match(row, { status: 'failed', attempts: 1, last_error_code: 'upstream_connection_error' });
  t.match(await attemptRows(gateway.db, row.id), [{ error_code: 'upstream_connection_error', upstream_status: null }]);
});

for (const [name, headers, body, detail] of [
  ['a body that is not the gzip it says it is', { 'content-encoding': 'gzip' }, Buffer.from('{"object":"chat.completion"}'), 'the 2xx body is not valid gzip'],
  [
    'a gzip body cut short',
    { 'content-encoding': 'gzip' },
    zlib.gzipSync(JSON.stringify(completionFor({ messages: [{ content: 'x' }] }))).subarray(0, 20),
    'the 2xx body is not valid gzip',
  ],
  [
    'a content-encoding the gateway does not read',
    { 'content-encoding': 'compress' },
    Buffer.from(JSON.stringify(completionFor({ messages: [{ content: 'x' }] }))),
    "the 2xx body's content-encoding is not one the gateway reads (gzip, deflate, br, zstd)",
  ],
] as const) {
  t.test(`${name}: upstream_invalid_response, saying so`, async (t) => {
    const { row, attempts } = await answeredWith(t, headers, body);
    t.match(row, { status: 'failed', attempts: 1, last_error_code: 'upstream_invalid_response' });
    t.match(attempts, [{ upstream_status: 200, error_code: 'upstream_invalid_response', error_detail: detail }]);
  });
}

/**
 * A gateway whose upstream answers with `answer` 200 ms into a 1,000 ms timeout, after which this
 * process (the gateway's worker is in it) is kept busy at once until 1,500 ms, before it has read
 * the answer: as a process held off the CPU (a busy host) wakes with its timers due and unread
 * answers in its sockets, and runs the timers first.
 */
async function heldOffAfter(t: Test, answer: (response: http.ServerResponse) => void) {
  const timeoutMs = 1_000;
  const server = http.createServer(async (request, response) => {
    for await (const _ of request);
    const arrivedAt = Date.now();
    setTimeout(() => {
      // (Both in one check phase: the answer is written, then the process is busy.)
      setImmediate(() => answer(response));
      setImmediate(() => {
        while (Date.now() < arrivedAt + timeoutMs * 1.5);
      });
    }, 200);
  });
  const port = await listenOnLoopback(t, server);
  const gateway = await startTestGateway(t, {
    env: { UPSTREAM_BASE_URL: `http://127.0.0.1:${port}/v1`, MAX_ATTEMPTS: '1', UPSTREAM_TIMEOUT_MS: String(timeoutMs) },
  });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const accepted = await client.post({ model: 'gpt-test', messages: userMessage() });
  const row = await waitForRow(gateway.db, accepted.body.id, isTerminal);
  return { row, attempts: await attemptRows(gateway.db, row.id) };
}

t.test('an answer that came in time while the worker was held off the CPU past its timeout is taken, not a timeout', async (t) => {
  const completion = JSON.stringify(completionFor({ model: 'gpt-test', messages: userMessage() }));
  const { row, attempts } = await heldOffAfter(t, (response) => response.writeHead(200, { 'content-type': 'application/json' }).end(completion));
  t.match(row, { status: 'completed', attempts: 1 });
  t.match(attempts, [{ outcome: 'succeeded', upstream_status: 200 }]);
});

for (const [name, answer] of [
  ['a connection reset', (response: http.ServerResponse) => response.socket!.resetAndDestroy()],
  [
    'a connection closed mid-body',
    (response: http.ServerResponse) => {
      response.writeHead(200, { 'content-type': 'application/json', 'content-length': '4096' });
      response.write('{"id":"chatcmpl-cut","object":"chat.completion","choi');
      response.socket!.destroy();
    },
  ],
] as const) {
  t.test(`${name} in time while the worker was held off the CPU past its timeout is a connection error, not a timeout`, async (t) => {
    const { row, attempts } = await heldOffAfter(t, answer);
    t.match(row, { status: 'failed', attempts: 1, last_error_code: 'upstream_connection_error' });
    t.match(attempts, [{ outcome: 'failed', error_code: 'upstream_connection_error' }]);
  });
}
