// UPSTREAM_ANSWER_MEMORY_MB: large upstream answers are read within a memory budget shared by a
// worker's calls. Past 16 KB, an answer reserves all it may still need (its content-length, else
// UPSTREAM_MAX_RESPONSE_BYTES, and that too when it is compressed; a br or zstd answer, that and
// its decoder's window from its first byte) or waits, its connection paused, in turn; its call's
// signal (a timeout, a cancel, a shutdown) ends the wait.
import http from 'node:http';
import zlib from 'node:zlib';
import t, { type Test } from 'tap';
import { AnswerMemory } from '../../src/upstream/answer-memory.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { listenOnLoopback } from '../helpers/ports.ts';
import { attemptRows, isTerminal, waitForRow } from '../helpers/rows.ts';
import { completionFor } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';

const MiB = 1024 * 1024;

t.test('reservations are granted in turn, as far as the budget goes; an abort leaves the line', async (t) => {
  const memory = new AnswerMemory(10);
  const never = new AbortController().signal;
  const releaseFirst = await memory.reserve(6, never);
  const granted: string[] = [];
  const second = memory.reserve(6, never).then((release) => (granted.push('second'), release));
  const leaving = new AbortController();
  const third = memory.reserve(2, leaving.signal).then(
    (release) => (granted.push('third'), release),
    (error: unknown) => error,
  );
  const fourth = memory.reserve(3, never).then((release) => (granted.push('fourth'), release));
  await Promise.resolve();
  t.same(granted, [], 'the third would fit, but waits behind the second');
  t.equal(memory.waiting, 3);

  leaving.abort(new Error('timed out'));
  t.match(await third, { message: 'timed out' }, 'an aborted wait rejects with the reason');
  t.equal(memory.waiting, 2);

  releaseFirst();
  releaseFirst();
  const releaseSecond = await second;
  const releaseFourth = await fourth;
  t.same(granted, ['second', 'fourth'], 'the release lets in both that now fit, in turn; releasing twice counts once');
  t.equal(memory.reserved, 9);
  t.equal(memory.waiting, 0);

  releaseSecond();
  releaseFourth();
  t.equal(memory.reserved, 0);
});

t.test('a reservation larger than the budget takes the whole budget, so it is never waited for forever', async (t) => {
  const memory = new AnswerMemory(10);
  const never = new AbortController().signal;
  const release = await memory.reserve(25, never);
  t.equal(memory.reserved, 10);
  const next = memory.reserve(1, never);
  t.equal(memory.waiting, 1);
  release();
  (await next)();
  t.equal(memory.reserved, 0);
});

/**
 * A loopback upstream whose answers are valid completions padded to `size` bytes, with a
 * content-length or without (`announced`): the headers and their first 32 KB at once, the rest
 * when `finish()` is called.
 */
async function startLargeAnswers(t: Test, size: number, announced = false) {
  const held: (() => void)[] = [];
  let finished = false;
  const server = http.createServer(async (request, response) => {
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    const completion = completionFor(JSON.parse(Buffer.concat(chunks).toString('utf8')));
    const text = JSON.stringify({ ...completion, padding: '' });
    const body = `${text.slice(0, -2)}${'x'.repeat(size - text.length)}"}`;
    response.writeHead(200, { 'content-type': 'application/json', ...(announced ? { 'content-length': String(size) } : {}) });
    response.write(body.slice(0, 32 * 1024));
    const rest = () => response.end(body.slice(32 * 1024));
    if (finished) rest();
    else held.push(rest);
  });
  const port = await listenOnLoopback(t, server);
  return {
    baseUrl: `http://127.0.0.1:${port}/v1`,
    get calls() {
      return held.length;
    },
    finish() {
      finished = true;
      for (const rest of held.splice(0)) rest();
    },
  };
}

/** The answer-memory gauges of a test gateway's /metrics. */
async function gaugesOf(metricsUrl: string) {
  const samples = parseMetrics(await (await fetch(`${metricsUrl}/metrics`)).text());
  return {
    reserved: samples.get('gateway_upstream_answer_memory_bytes'),
    waiting: samples.get('gateway_upstream_answers_waiting_for_memory'),
  };
}

/** Polls the gauges until they read `expected`. */
async function gaugesReach(metricsUrl: string, expected: { reserved: number; waiting: number }): Promise<void> {
  let last = {};
  await until(
    async () => {
      last = await gaugesOf(metricsUrl);
      return JSON.stringify(last) === JSON.stringify(expected);
    },
    () => `the gauges to read ${JSON.stringify(expected)}; last read ${JSON.stringify(last)}`,
    15_000,
  );
}

const settings = (baseUrl: string, answerMemoryMb: number) => ({
  UPSTREAM_BASE_URL: baseUrl,
  UPSTREAM_MAX_RESPONSE_BYTES: String(MiB),
  UPSTREAM_ANSWER_MEMORY_MB: String(answerMemoryMb),
  UPSTREAM_TIMEOUT_MS: '30000',
  MAX_ATTEMPTS: '1',
  METRICS_PORT: '0',
});

t.test('six 600 KB answers with room for two: two read at a time, the others wait their turn, all complete', async (t) => {
  const upstream = await startLargeAnswers(t, 600 * 1024);
  const gateway = await startTestGateway(t, { env: settings(upstream.baseUrl, 2) });
  t.equal(gateway.config.upstreamAnswerMemoryBytes, 2 * MiB);
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const ids: string[] = [];
  for (let i = 0; i < 6; i++) ids.push((await client.post({ model: 'gpt-test', messages: userMessage() })).body.id);

  // Each answer's first 32 KB is in: past 16 KB, each reserved UPSTREAM_MAX_RESPONSE_BYTES (no
  // content-length), or waits for it.
  await gaugesReach(gateway.metricsUrl, { reserved: 2 * MiB, waiting: 4 });
  t.pass('two answers being read, four waiting for their share');
  t.equal(upstream.calls, 6, 'all six calls answered in part');

  upstream.finish();
  for (const id of ids) {
    const row = await waitForRow(gateway.db, id, isTerminal, 20_000);
    t.equal(row.status, 'completed', `${id} completed`);
  }
  const { rows } = await gateway.pool.query(`select octet_length(result::text) as size from gateway.requests`);
  t.same(
    rows.map((row) => row.size),
    Array(6).fill(600 * 1024),
    'each result stored whole',
  );
  t.same(await gaugesOf(gateway.metricsUrl), { reserved: 0, waiting: 0 }, 'the memory given back');
});

t.test('an answer with a content-length reserves that much', async (t) => {
  const upstream = await startLargeAnswers(t, 600 * 1024, true);
  const gateway = await startTestGateway(t, { env: settings(upstream.baseUrl, 2) });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const ids: string[] = [];
  for (let i = 0; i < 6; i++) ids.push((await client.post({ model: 'gpt-test', messages: userMessage() })).body.id);
  await gaugesReach(gateway.metricsUrl, { reserved: 3 * 600 * 1024, waiting: 3 });
  t.pass('three of 600 KB in 2 MiB, three waiting');
  upstream.finish();
  for (const id of ids) t.match(await waitForRow(gateway.db, id, isTerminal, 20_000), { status: 'completed' });
  t.same(await gaugesOf(gateway.metricsUrl), { reserved: 0, waiting: 0 }, 'the memory given back');
});

t.test('a compressed answer reserves UPSTREAM_MAX_RESPONSE_BYTES, whatever its content-length (the encoded size)', async (t) => {
  let finish = () => {};
  const server = http.createServer(async (request, response) => {
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    const completion = completionFor(JSON.parse(Buffer.concat(chunks).toString('utf8')));
    const body = zlib.gzipSync(JSON.stringify({ ...completion, padding: 'x'.repeat(600 * 1024) }));
    response.writeHead(200, { 'content-type': 'application/json', 'content-encoding': 'gzip', 'content-length': String(body.byteLength) });
    // All but the gzip trailer: the text decodes, and its end is held back.
    response.write(body.subarray(0, -8));
    finish = () => response.end(body.subarray(-8));
  });
  const port = await listenOnLoopback(t, server);
  const gateway = await startTestGateway(t, { env: settings(`http://127.0.0.1:${port}/v1`, 2) });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const id = (await client.post({ model: 'gpt-test', messages: userMessage() })).body.id;
  await gaugesReach(gateway.metricsUrl, { reserved: MiB, waiting: 0 });
  t.pass('a content-length of a few KB, and 1 MiB reserved');
  finish();
  t.match(await waitForRow(gateway.db, id, isTerminal, 20_000), { status: 'completed' });
  t.same(await gaugesOf(gateway.metricsUrl), { reserved: 0, waiting: 0 }, 'the memory given back');
});

t.test('a brotli answer reserves its window and UPSTREAM_MAX_RESPONSE_BYTES before a byte of it is decoded', async (t) => {
  let finish = () => {};
  const server = http.createServer(async (request, response) => {
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    const completion = completionFor(JSON.parse(Buffer.concat(chunks).toString('utf8')));
    const body = zlib.brotliCompressSync(JSON.stringify(completion));
    response.writeHead(200, { 'content-type': 'application/json', 'content-encoding': 'br' });
    // Its first bytes, far less than 16 KB once decoded; the rest held back.
    response.write(body.subarray(0, 8));
    finish = () => response.end(body.subarray(8));
  });
  const port = await listenOnLoopback(t, server);
  const gateway = await startTestGateway(t, { env: settings(`http://127.0.0.1:${port}/v1`, 64) });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const id = (await client.post({ model: 'gpt-test', messages: userMessage() })).body.id;
  await gaugesReach(gateway.metricsUrl, { reserved: MiB + 16 * MiB, waiting: 0 });
  t.pass("1 MiB for the answer and 16 MiB for brotli's window");
  finish();
  t.match(await waitForRow(gateway.db, id, isTerminal, 20_000), { status: 'completed' });
  t.same(await gaugesOf(gateway.metricsUrl), { reserved: 0, waiting: 0 }, 'the memory given back');
});

t.test('an answer waiting for memory leaves the line when its request is cancelled', async (t) => {
  const upstream = await startLargeAnswers(t, 600 * 1024);
  const gateway = await startTestGateway(t, { env: settings(upstream.baseUrl, 1) });
  const key = await gateway.createKey({ mode: 'live' });
  const client = clientFor(gateway.url, key);
  const reading = (await client.post({ model: 'gpt-test', messages: userMessage() })).body.id;
  await gaugesReach(gateway.metricsUrl, { reserved: MiB, waiting: 0 });
  const waiting = (await client.post({ model: 'gpt-test', messages: userMessage() })).body.id;
  await gaugesReach(gateway.metricsUrl, { reserved: MiB, waiting: 1 });

  const cancelled = await send(gateway.url, { method: 'POST', path: `/v1/requests/${waiting}/cancel`, key });
  t.match(cancelled.body, { id: waiting, status: 'cancelled' });
  await gaugesReach(gateway.metricsUrl, { reserved: MiB, waiting: 0 });
  t.pass('out of the line, the memory still held by the answer being read');
  t.match(await attemptRows(gateway.db, waiting), [{ outcome: 'cancelled' }]);

  upstream.finish();
  t.match(await waitForRow(gateway.db, reading, isTerminal, 20_000), { status: 'completed' });
  t.same(await gaugesOf(gateway.metricsUrl), { reserved: 0, waiting: 0 }, 'the memory given back');
});
