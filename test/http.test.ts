// The HTTP surface around the two endpoints: health checks, unknown routes and methods,
// requests that Node's HTTP server would answer itself, and a 500 that reveals nothing.
import t from 'tap';
import http from 'node:http';
import net from 'node:net';
import { Writable } from 'node:stream';
import { setTimeout as sleep } from 'node:timers/promises';
import pg from 'pg';
import { listMigrations } from '../src/db/migrate.ts';
import { createPool } from '../src/db/pool.ts';
import { createOpsApp } from '../src/http/app.ts';
import { createLogger } from '../src/logger.ts';
import { Metrics } from '../src/metrics.ts';
import { startTestGateway } from './helpers/gateway.ts';
import { clientFor, send, userMessage, type Answer } from './helpers/http.ts';
import { parseMetrics } from './helpers/metrics.ts';
import { listenOnLoopback } from './helpers/ports.ts';
import { until } from './helpers/wait.ts';

t.test('healthz and readyz need no key; readyz says ready or not, and never which schema', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const health = await send(gateway.url, { path: '/healthz' });
  t.same([health.status, health.body], [200, { status: 'ok' }]);
  const latest = (await listMigrations()).at(-1)!.id;
  const ready = await send(gateway.url, { path: '/readyz' });
  t.same([ready.status, ready.body], [200, { status: 'ready' }], 'no schema version');

  await gateway.pool.query('delete from gateway.migrations where id = $1', [latest]);
  // /readyz answers from a look at most a second old.
  let behind!: Answer;
  await until(async () => (behind = await send(gateway.url, { path: '/readyz' })).status !== 200, 'the next look', 3_000);
  t.equal(behind.status, 503);
  t.equal(behind.body.error.code, 'service_unavailable');
  t.ok(behind.headers.get('retry-after'));
  t.notMatch(behind.text, /migrat|schema|\d{2}/i, 'nor which migration is missing');
  t.ok(
    gateway.logs.some((line) => line.includes('"applied":' + (latest - 1)) && line.includes(`"expected":${latest}`)),
    'the log says',
  );
});

t.test('200 concurrent /readyz calls share one look at the database, and the next second brings a new one', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  // The probes of an ops app of the test's own, on a pool that counts the connections it takes:
  // a look takes two (the migrations table exists, and its newest row).
  const pool = createPool(gateway.databaseUrl, { max: 10, applicationName: 'readyz-test', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  let acquired = 0;
  pool.on('acquire', () => acquired++);
  const app = createOpsApp({ config: gateway.config, pool, metrics: new Metrics(), logger: createLogger({ logLevel: 'silent' }) });
  const url = `http://127.0.0.1:${await listenOnLoopback(t, http.createServer(app.callback()))}`;

  const started = performance.now();
  const answers = await Promise.all(Array.from({ length: 200 }, () => send(url, { path: '/readyz' })));
  const seconds = (performance.now() - started) / 1000;
  t.same(new Set(answers.map((answer) => answer.status)), new Set([200]));
  // One look, and one more for each whole second the calls took (on a busy machine, 200 calls
  // can take more than one).
  t.ok(acquired / 2 <= 1 + Math.floor(seconds), `at most one look a second: ${acquired / 2} for 200 calls in ${seconds.toFixed(2)} s`);
  const looked = acquired;
  await sleep(1_100);
  t.equal((await send(url, { path: '/readyz' })).status, 200);
  t.equal(acquired, looked + 2, 'a second later, one look more');
});

t.test('a look that finds no pooled connection free in time (overload) makes /readyz a 503, said once per look in the log', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  // The probes of an ops app of the test's own, on a pool of one connection that the test holds.
  const pool = new pg.Pool({ connectionString: gateway.databaseUrl, max: 1, connectionTimeoutMillis: 200 });
  t.teardown(() => pool.end());
  // Opening it may take longer than the 200 ms on a busy machine: tried until it is open.
  let held: pg.PoolClient | undefined;
  await until(async () => (held = await pool.connect().catch(() => undefined)) !== undefined, 'the connection to hold', 15_000);
  const lines: string[] = [];
  const sink = new Writable({
    write(chunk: Buffer, _encoding, done) {
      lines.push(...chunk.toString('utf8').split('\n').filter(Boolean));
      done();
    },
  });
  const app = createOpsApp({ config: gateway.config, pool, metrics: new Metrics(), logger: createLogger({ logLevel: 'info' }, sink) });
  const url = `http://127.0.0.1:${await listenOnLoopback(t, http.createServer(app.callback()))}`;

  const answers = await Promise.all(Array.from({ length: 20 }, () => send(url, { path: '/readyz' })));
  t.same(new Set(answers.map((answer) => answer.status)), new Set([503]), 'every call a 503, none a 500');
  t.ok(answers.every((answer) => answer.body.error.code === 'service_unavailable' && answer.headers.get('retry-after')), 'service_unavailable, with retry-after');
  t.equal(lines.filter((line) => line.includes('not ready: the database could not be read')).length, 1, 'the log says why once, for the look they shared');
  t.same(lines.filter((line) => line.includes('"level":"error"')), [], 'and logs no error');
  held!.release();
  await until(async () => (await send(url, { path: '/readyz' })).status === 200, 'ready once a connection is free', 3_000);
});

t.test('unknown routes are 404 route_not_found; wrong methods 405 method_not_allowed, with the methods the path takes', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  for (const path of ['/', '/v1', '/v2/chat/completions', '/v1/chat/completions/extra', '/v1/requests']) {
    const answer = await send(gateway.url, { path, key });
    t.equal(answer.status, 404, `${path}: 404`);
    t.same(answer.body.error, { message: answer.body.error.message, type: 'not_found_error', code: 'route_not_found', param: null });
  }
  for (const [method, path, allow] of [
    ['GET', '/v1/chat/completions', 'POST'],
    ['PUT', '/v1/chat/completions', 'POST'],
    ['DELETE', '/v1/requests/req_00000000000000000000', 'HEAD, GET'],
    ['PATCH', '/healthz', 'HEAD, GET'],
    // A method no route of any path takes.
    ['PROPFIND', '/v1/requests/req_00000000000000000000/cancel', 'POST'],
  ]) {
    const answer = await send(gateway.url, { method: method!, path: path!, key });
    t.equal(answer.status, 405, `${method} ${path}: 405`);
    t.equal(answer.body.error.code, 'method_not_allowed');
    t.equal(answer.body.error.type, 'invalid_request_error');
    // RFC 9110: a 405 names the methods the target takes.
    t.equal(answer.headers.get('allow'), allow, `${method} ${path}: Allow names ${allow}`);
  }
  const options = await send(gateway.url, { method: 'OPTIONS', path: '/v1/chat/completions', key });
  t.same([options.status, options.headers.get('allow')], [200, 'POST'], 'OPTIONS: 200, with the methods in Allow');
});

/** Writes `text` on a new connection and reads until the server closes it (or 3 s pass). */
function sendRaw(baseUrl: string, text: string): Promise<{ status: number; headers: string; body: any }> {
  const url = new URL(baseUrl);
  return new Promise((resolve) => {
    const socket = net.connect(Number(url.port), url.hostname);
    const chunks: Buffer[] = [];
    const finish = () => {
      clearTimeout(timer);
      socket.destroy();
      const answer = Buffer.concat(chunks).toString('utf8');
      const head = answer.indexOf('\r\n\r\n');
      let body: unknown = answer.slice(head + 4);
      try {
        body = JSON.parse(body as string);
      } catch {}
      resolve({ status: Number(/^HTTP\/1\.1 (\d{3})/.exec(answer)?.[1] ?? 0), headers: answer.slice(0, head + 2), body });
    };
    const timer = setTimeout(finish, 3_000);
    socket.on('data', (chunk: Buffer) => chunks.push(chunk));
    socket.on('error', () => {});
    socket.on('close', finish);
    socket.write(text);
  });
}

t.test('an HTTP/1.1 request without Host is a 400 invalid_body in the contract\'s shape, and its connection closed', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  for (const request of ['GET /healthz HTTP/1.1\r\n\r\n', 'POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}']) {
    const answer = await sendRaw(gateway.url, request);
    t.equal(answer.status, 400, request.slice(0, request.indexOf('\r')));
    t.match(answer.headers, /\r\ncontent-type: application\/json; charset=utf-8\r\n/i);
    t.match(answer.headers, /\r\nconnection: close\r\n/i);
    t.same(answer.body, { error: { message: answer.body?.error?.message, type: 'invalid_request_error', code: 'invalid_body', param: null } });
  }
  t.same((await sendRaw(gateway.url, 'GET /healthz HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n')).body, { status: 'ok' }, 'with Host, it is served');
  t.same((await sendRaw(gateway.url, 'GET /healthz HTTP/1.0\r\n\r\n')).body, { status: 'ok' }, 'as HTTP/1.0 without Host');
});

t.test('an Expect other than 100-continue is ignored: the request is served as without it', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const health = await sendRaw(gateway.url, 'GET /healthz HTTP/1.1\r\nHost: gateway\r\nExpect: 200-ok\r\nConnection: close\r\n\r\n');
  t.same([health.status, health.body], [200, { status: 'ok' }]);
  const submission = await sendRaw(
    gateway.url,
    'POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nExpect: 200-ok\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}',
  );
  t.equal(submission.status, 401);
  t.equal(submission.body?.error?.code, 'missing_api_key', 'a submission without a key, refused in the contract\'s shape');
});

t.test('Expect: 100-continue: a submission refused before its body is read gets no 100 Continue, so its body is never sent; an accepted one gets it before its body is read', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { SIGNATURES: 'optional' } });
  const key = await gateway.createKey();
  const url = new URL(gateway.url);
  /** Sends the head of a submission with Expect: 100-continue, and its body only once told to continue. */
  const expecting = (apiKey: string, body: string) =>
    new Promise<string>((resolve) => {
      const socket = net.connect(Number(url.port), url.hostname);
      let answer = '';
      const timer = setTimeout(() => socket.destroy(), 5_000);
      socket.setEncoding('utf8');
      socket.on('data', (chunk: string) => {
        answer += chunk;
        if (answer === 'HTTP/1.1 100 Continue\r\n\r\n') socket.write(body);
      });
      socket.on('error', () => {});
      socket.on('close', () => {
        clearTimeout(timer);
        resolve(answer);
      });
      socket.write(
        `POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer ${apiKey}\r\nContent-Type: application/json\r\n` +
          `Content-Length: ${Buffer.byteLength(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n`,
      );
    });
  const body = JSON.stringify({ model: 'test-echo', messages: userMessage('continued') });

  const refused = await expecting('svc_test_000000000000000000000000000000000000000000', body);
  t.match(refused, /^HTTP\/1\.1 401 /, 'an unknown key: 401 at once, with no 100 Continue before it');

  const accepted = await expecting(key.api_key, body);
  t.match(accepted, /^HTTP\/1\.1 100 Continue\r\n\r\nHTTP\/1\.1 202 /, 'a known key: 100 Continue, then, its body sent, 202');
});

t.test('CONNECT is a 405 method_not_allowed in the contract\'s shape, and its connection closed', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  for (const target of ['example.com:443', '/v1/chat/completions']) {
    const answer = await sendRaw(gateway.url, `CONNECT ${target} HTTP/1.1\r\nHost: ${target}\r\n\r\n`);
    t.equal(answer.status, 405, target);
    t.match(answer.headers, /\r\ncontent-type: application\/json; charset=utf-8\r\n/i);
    t.match(answer.headers, /\r\nconnection: close\r\n/i);
    t.same(answer.body, { error: { message: answer.body?.error?.message, type: 'invalid_request_error', code: 'method_not_allowed', param: null } });
  }
});

t.test('the answers the server gives itself, before the app (not HTTP, headers too large, no Host, CONNECT), are counted in gateway_http_requests_total', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { METRICS_PORT: '0' } });
  const largeHeaders = `GET /healthz HTTP/1.1\r\nHost: gateway\r\nX-Large: ${'x'.repeat(20_000)}\r\n\r\n`;
  for (const [baseUrl, request, status] of [
    [gateway.url, 'GET / HTTP/9.9\r\n\r\n', 400],
    [gateway.url, largeHeaders, 413],
    [gateway.metricsUrl, largeHeaders, 413],
    [gateway.url, 'GET /healthz HTTP/1.1\r\n\r\n', 400],
    [gateway.url, 'CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n', 405],
  ] as const) {
    t.equal((await sendRaw(baseUrl, request)).status, status, `${request.slice(0, request.indexOf('\r'))}: ${status}`);
  }
  const samples = parseMetrics((await send(gateway.metricsUrl, { path: '/metrics' })).text);
  const counted = (method: string, status: number) => samples.get(`gateway_http_requests_total{method="${method}",route="unmatched",status="${status}"}`);
  t.equal(counted('unknown', 400), 1, 'not HTTP: its method unknown');
  t.equal(counted('unknown', 413), 2, 'headers too large, on PORT and on METRICS_PORT');
  t.equal(counted('GET', 400), 1, 'an HTTP/1.1 request without Host');
  t.equal(counted('CONNECT', 405), 1, 'CONNECT');
});

t.test('a request answered before its body is read (refused at once) has its connection closed if the rest keeps coming', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { MAX_BODY_BYTES: '65536' } });
  const key = await gateway.createKey();
  const url = new URL(gateway.url);
  const chunk = Buffer.alloc(16_384, 'a');
  const cases = [
    ['no key, 1 GB announced', 'Content-Length: 1000000000', chunk, 401],
    ['a key, a chunked body past MAX_BODY_BYTES', `Authorization: Bearer ${key.api_key}\r\nTransfer-Encoding: chunked`, Buffer.from(`4000\r\n${chunk}\r\n`), 413],
  ] as const;
  for (const [name, headers, piece, status] of cases) {
    // The body is sent at about 1.6 MB/s, as long as the connection takes it, for 20 s at most.
    const socket = net.connect(Number(url.port), url.hostname);
    let answer = '';
    let closed = false;
    socket.on('data', (data: Buffer) => (answer += data.toString('latin1')));
    socket.on('error', () => {});
    socket.on('close', () => (closed = true));
    socket.write(`POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n${headers}\r\n\r\n`);
    const giveUpAt = Date.now() + 20_000;
    while (!closed && Date.now() < giveUpAt) {
      socket.write(piece);
      await sleep(10);
    }
    socket.destroy();
    t.match(answer, new RegExp(`^HTTP/1\\.1 ${status} `), `${name}: answered ${status}`);
    t.ok(closed, `${name}: the gateway closed the connection rather than read the body on`);
  }
});

t.test('a keep-alive connection refused 30 times before its bodies are read gathers no listener per refusal (no emitter warns of a leak): the rest of each body is read off, and the connection served on', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const url = new URL(gateway.url);
  const warnings: string[] = [];
  const onWarning = (warning: Error) => warnings.push(`${warning.name}: ${warning.message}`);
  process.on('warning', onWarning);
  t.teardown(() => process.off('warning', onWarning));

  const socket = net.connect(Number(url.port), url.hostname);
  t.teardown(() => socket.destroy());
  let received = '';
  let arrived: () => void = () => {};
  let closed = false;
  socket.on('data', (data: Buffer) => {
    received += data.toString('latin1');
    arrived();
  });
  socket.on('close', () => {
    closed = true;
    arrived();
  });
  const answers = () => received.match(/HTTP\/1\.1 \d{3} /g) ?? [];
  const body = JSON.stringify({ model: 'gpt-x', messages: [userMessage('hi')] });
  const rounds = 30;
  for (let i = 0; i < rounds; i++) {
    // The head alone: the request is refused (no key) before any of its body has come.
    socket.write(`POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\n\r\n`);
    while (answers().length <= i && !closed) await new Promise<void>((resolve) => (arrived = resolve));
    if (closed) break;
    socket.write(body);
  }
  if (!closed) socket.write('GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n');
  while (!received.includes('{"status":"ok"}') && !closed) await new Promise<void>((resolve) => (arrived = resolve));
  t.same(answers(), [...Array(rounds).fill('HTTP/1.1 401 '), 'HTTP/1.1 200 '], 'every refusal answered, and the connection then served');
  t.same(warnings.filter((warning) => warning.startsWith('MaxListenersExceededWarning')), [], 'no emitter warned of more than 10 listeners');
});

t.test('a connection answered outside the app (not HTTP, CONNECT) is closed even if its client keeps its side open', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const url = new URL(gateway.url);
  for (const request of ['GET / HTTP/9.9\r\n\r\n', 'CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n']) {
    // A client that never ends its side: only a write tells it whether the gateway's side is gone.
    const socket = net.connect({ port: Number(url.port), host: url.hostname, allowHalfOpen: true });
    let answer = '';
    let closed = false;
    socket.on('data', (data: Buffer) => (answer += data.toString('latin1')));
    socket.on('error', () => {});
    socket.on('close', () => (closed = true));
    socket.write(request);
    const giveUpAt = Date.now() + 15_000;
    while (!closed && Date.now() < giveUpAt) {
      await sleep(500);
      if (!closed) socket.write('x');
    }
    socket.destroy();
    t.match(answer, /^HTTP\/1\.1 40[05] /, `${request.slice(0, request.indexOf('\r'))}: answered`);
    t.ok(closed, `${request.slice(0, request.indexOf('\r'))}: the gateway let go of the connection`);
  }
});

t.test('an internal failure is a 500 internal_error that reveals nothing, and is logged', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  await gateway.pool.query('alter table gateway.requests rename column model to model_renamed');
  const answer = await client.post({ model: 'm', messages: userMessage() });
  t.equal(answer.status, 500);
  t.same(answer.body, {
    error: { message: 'The server failed to handle the request.', type: 'api_error', code: 'internal_error', param: null },
  });
  t.notMatch(answer.text, /column|select|insert|gateway\.|at .*\.ts/i, 'no SQL, no stack');
  t.ok(gateway.logs.some((line) => line.includes('"unhandled error"') && line.includes('model')), 'the cause is in the log');
});
