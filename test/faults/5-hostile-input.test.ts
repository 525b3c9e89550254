// Fault 5: 10,000 generated hostile requests (fast-check): bodies, JSON, headers, content
// types, ids in lookup paths, signatures and bearer keys, most of them nearly right. None may
// get a 5xx; every error answer must be in the contract's shape with the type and code of its
// status; none may get through without an active key and a correct signature; and a refused
// request must store nothing (gateway.requests and gateway.signature_nonces change only with
// accepted requests). Then a few hundred requests that are not even valid HTTP.
import http from 'node:http';
import net from 'node:net';
import fc from 'fast-check';
import t from 'tap';
import { REQUEST_ID } from '../../src/ids.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { revokeKey } from '../../src/keys/service.ts';
import { call, tally } from './support/client.ts';
import { faultContext } from './support/context.ts';
import { errorShapeProblem, preview } from './support/contract.ts';
import { hostileRequest, resolve, sendResolved, type KeyName, type RawAnswer, type Resolved, type World } from './support/hostile.ts';
import { privateContent } from './support/run.ts';

const RUNS = 10_000;
const RAW_RUNS = 500;
const MAX_BODY_BYTES = 131_072;

t.test('10,000 hostile requests: no 5xx, every error in the contract shape, nothing through without a key and a signature, nothing stored for a refused one', async (t) => {
  const faults = await faultContext(t, '5-hostile-input');
  // Accepted live-mode requests fail at once (their upstream refuses every one as a bad request:
  // the request's own fault, not retried), so that a wait=true one is not held for the whole wait.
  const upstream = await startFakeUpstream(t, () => ({ status: 400, json: { error: { message: 'refused' } } }));
  const env = { MAX_BODY_BYTES: String(MAX_BODY_BYTES), WAIT_TIMEOUT_MS: '1000', UPSTREAM_BASE_URL: upstream.baseUrl };
  const gateway = await faults.start('all', { env });
  const keys = {
    a: await faults.createKey({ project: 'faults-hostile', mode: 'test' }),
    live: await faults.createKey({ project: 'faults-hostile', mode: 'live' }),
    b: await faults.createKey({ project: 'faults-hostile-other', mode: 'test' }),
    revoked: await faults.createKey({ project: 'faults-hostile', mode: 'test' }),
  };
  const world: World = {
    keys,
    ids: { a: [], live: [], b: [], revoked: [] },
    acceptedNonces: { a: [], live: [], b: [], revoked: [] },
    maxBodyBytes: MAX_BODY_BYTES,
  };
  // A few stored requests of each key, to look up and to be refused.
  for (const name of ['a', 'live', 'b', 'revoked'] as KeyName[]) {
    for (let i = 0; i < 2; i++) {
      const answer = await call(gateway.url!, {
        path: '/v1/chat/completions',
        key: keys[name],
        body: { model: 'test-echo', messages: [{ role: 'user', content: privateContent(`scenario 5 stored ${name} ${i}`) }] },
      });
      world.ids[name].push(answer.body.id);
    }
  }
  await revokeKey(faults.db, keys.revoked.id);
  // Requests of the revoked key belong to project "faults-hostile", test mode: key a's.
  world.ids.a.push(...world.ids.revoked);

  const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  t.teardown(() => agent.destroy());
  const counts = async () => {
    const { rows } = await faults.pool.query<{ requests: number; nonces: number }>(
      `select (select count(*) from gateway.requests)::int as requests, (select count(*) from gateway.signature_nonces)::int as nonces`,
    );
    return rows[0]!;
  };
  const before = await counts();
  let rowsNow = before;
  const outcomes: string[] = [];
  let accepted = 0;
  let acceptedPosts = 0;
  let newRows = 0;
  // A wait=true request answered 200 is stored under an id its client never saw.
  let answeredWithCompletion = 0;

  const started = Date.now();
  const details = await fc.check(
    fc.asyncProperty(hostileRequest, async (hostile) => {
      const request = resolve(hostile, world);
      // Runs are one at a time and nothing else adds rows: the counts after the last run are
      // the counts before this one.
      const rowsBefore = rowsNow;
      const answer = await sendResolved(agent, gateway.url!, request);
      const rowsAfter = (rowsNow = await counts());
      const problems = judge(request, answer, world, rowsAfter.requests - rowsBefore.requests, rowsAfter.nonces - rowsBefore.nonces);
      outcomes.push(answer.status ? `${answer.status} ${(answer.body as any)?.error?.code ?? ''}`.trim() : 'no answer');
      if (problems.length > 0) throw new Error(`${problems.join('; ')}\n  sent ${describe(request)}\n  got ${answer.status || answer.failure} ${preview(answer.text, 300)}`);
      if (answer.status >= 200 && answer.status < 300 && request.method === 'POST' && request.key) {
        accepted += 1;
        acceptedPosts += 1;
        newRows += rowsAfter.requests - rowsBefore.requests;
        if (request.nonce) world.acceptedNonces[request.key].push(request.nonce);
        if (answer.status === 202) world.ids[request.key === 'revoked' ? 'a' : request.key].push((answer.body as any).id);
        if (answer.status === 200 && answer.headers.get('idempotent-replayed') !== 'true') answeredWithCompletion += 1;
      } else if (answer.status >= 200 && answer.status < 300) {
        accepted += 1;
      }
    }),
    { numRuns: RUNS, plugins: [fc.interruptAfterTimeLimit(240_000, { failOnInterrupt: true })] },
  );
  const tookMs = Date.now() - started;
  if (details.failed) {
    t.comment(`fast-check seed ${details.seed}, path ${details.counterexamplePath}; failed after ${details.numRuns} runs and ${details.numShrinks} shrinks`);
    t.comment(`counterexample: ${preview(fc.stringify(details.counterexample), 2_000)}`);
  }
  t.notOk(details.failed, `${details.numRuns} hostile requests, none answered against the rules${details.failed ? `: ${String((details.errorInstance as Error | undefined)?.message)}` : ''}`);
  t.comment(`${outcomes.length} requests in ${tookMs} ms (seed ${details.seed}): ${tally(outcomes)}`);
  t.comment(`${accepted} got through (${acceptedPosts} POSTs, ${newRows} new requests), all with an active key and a correct signature`);

  // Nothing else was stored: the tables hold what was there and what was accepted.
  const after = await counts();
  t.equal(after.requests - before.requests, newRows, 'gateway.requests grew only by the accepted requests');
  t.equal(after.nonces - before.nonces, acceptedPosts, 'gateway.signature_nonces only by their nonces');
  const { rows } = await faults.pool.query<{ id: string }>('select id from gateway.requests');
  const stored = new Set(rows.map((row) => row.id));
  const acknowledged = new Set([...world.ids.a, ...world.ids.live, ...world.ids.b]);
  t.same([...acknowledged].filter((id) => !stored.has(id)), [], 'every acknowledged id is stored');
  t.equal(rows.filter((row) => !acknowledged.has(row.id)).length, answeredWithCompletion, 'and the only other requests are those answered with their completion');
  t.ok(gateway.running, 'the gateway is still running');

  // Not even HTTP: requests Node's HTTP parser refuses, and some it takes.
  const rawOutcomes: string[] = [];
  const rawDetails = await fc.check(
    fc.asyncProperty(brokenHttp, async (bytes) => {
      const rowsBefore = await counts();
      const answer = await sendRaw(gateway.url!, bytes);
      const rowsAfter = await counts();
      rawOutcomes.push(answer.status ? `${answer.status} ${(answer.body as any)?.error?.code ?? ''}`.trim() : 'closed without an answer');
      const problems: string[] = [];
      if (answer.status >= 500) problems.push(`HTTP ${answer.status}`);
      if (answer.status >= 400) {
        const problem = errorShapeProblem(answer.status, answer.headers, answer.body);
        if (problem) problems.push(problem);
      }
      if (rowsAfter.requests !== rowsBefore.requests || rowsAfter.nonces !== rowsBefore.nonces) problems.push('rows were stored');
      if (problems.length > 0) throw new Error(`${problems.join('; ')}\n  sent ${preview(bytes.toString('latin1'), 300)}\n  got ${preview(answer.text, 300)}`);
    }),
    { numRuns: RAW_RUNS },
  );
  if (rawDetails.failed) t.comment(`counterexample: ${preview(JSON.stringify(rawDetails.counterexample?.[0]?.toString('latin1')), 1_000)}`);
  t.notOk(rawDetails.failed, `${rawDetails.numRuns} requests that are not valid HTTP: no 5xx, errors in the contract shape, nothing stored${rawDetails.failed ? `: ${String((rawDetails.errorInstance as Error | undefined)?.message)}` : ''}`);
  t.comment(`not valid HTTP: ${tally(rawOutcomes)}`);

  const health = await call(gateway.url!, { path: `/v1/requests/${world.ids.a[0]}`, key: keys.a });
  t.equal(health.status, 200, 'and afterwards the gateway answers as before');
  t.ok(gateway.running, 'still running');
  await faults.finish(t);
});

/** What is wrong with the answer to one hostile request. */
function judge(request: Resolved, answer: RawAnswer, world: World, newRequests: number, newNonces: number): string[] {
  const problems: string[] = [];
  if (answer.status === 0) return [`no answer: ${answer.failure}`];
  if (answer.status >= 500) problems.push(`HTTP ${answer.status}`);
  const ok = answer.status >= 200 && answer.status < 300;
  if (answer.status >= 400) {
    const problem = errorShapeProblem(answer.status, answer.headers, answer.body);
    if (problem) problems.push(problem);
  }
  const body = answer.body as any;
  const probe = request.method === 'GET' && /^\/(healthz|readyz)(\?|$)/.test(request.target);
  const options = request.method === 'OPTIONS' && answer.text === '';
  if (ok && !probe && !options) {
    if (!request.key) problems.push('got through without an active key');
    if (!request.correctlySigned) problems.push('got through without a correct signature');
    if (request.replayedPost) problems.push('got through with a replayed nonce');
    if (request.method === 'POST') {
      const replay = answer.headers.get('idempotent-replayed') === 'true';
      if (answer.status === 202 && !(body?.object === 'chat.completion.async' && REQUEST_ID.test(body?.id ?? ''))) problems.push(`202 that is not an acknowledgement: ${preview(body)}`);
      if (answer.status === 200 && body?.object !== 'chat.completion') problems.push(`200 that is not a chat completion: ${preview(body)}`);
      if (newRequests !== (replay ? 0 : 1)) problems.push(`accepted${replay ? ' (a replay)' : ''}, and ${newRequests} requests were stored`);
      if (newNonces !== 1) problems.push(`accepted, and ${newNonces} nonces were stored`);
    } else {
      if (newRequests !== 0 || newNonces !== 0) problems.push(`a ${request.method} stored ${newRequests} requests and ${newNonces} nonces`);
      if (request.method === 'GET' && request.key && !world.ids[request.key === 'revoked' ? 'a' : request.key].includes(body?.id)) {
        problems.push(`a lookup answered a request of another project or mode: ${preview(body)}`);
      }
    }
  }
  if (!ok && (newRequests !== 0 || newNonces !== 0)) problems.push(`refused with ${answer.status}, yet ${newRequests} requests and ${newNonces} nonces were stored`);
  // Authentication comes first on the two routes: a request without an active key is a 401.
  // (Unless Node's HTTP parser refuses the request line first: 400 for a path it cannot take.)
  const parserRefuses = answer.status === 400 && body?.error?.code === 'invalid_body' && /[^A-Za-z0-9\-._~:/?#[\]@!$&'()*+,;=%]/.test(request.target);
  const onRoute = (request.method === 'POST' && request.route === 'completions') || (request.method === 'GET' && request.route === 'lookup');
  if (onRoute && !parserRefuses && !request.key && !(answer.status === 401 && ['missing_api_key', 'invalid_api_key'].includes(body?.error?.code)) && answer.status !== 413) {
    problems.push(`without an active key, answered ${answer.status} ${body?.error?.code}, not 401`);
  }
  // And another project's or mode's request is a 404, as an unknown one is.
  if (request.method === 'GET' && !parserRefuses && request.key && request.correctlySigned && request.lookupOwner && request.lookupOwner !== (request.key === 'revoked' ? 'a' : request.key)) {
    if (!(answer.status === 404 && body?.error?.code === 'request_not_found') && answer.status !== 413) problems.push(`another's request answered ${answer.status}, not 404 request_not_found`);
  }
  return problems;
}

function describe(request: Resolved): string {
  const headers = Object.entries(request.headers)
    .map(([name, value]) => `${name}: ${preview(name === 'authorization' ? '(a key)' : Array.isArray(value) ? value.join(' | ') : value, 80)}`)
    .join('; ');
  return `${request.method} ${preview(request.target, 120)} [${headers}] body ${request.body ? preview(request.body.toString('latin1'), 200) : 'none'}`;
}

/** Raw request bytes that are not valid HTTP/1.1, or barely are. */
const brokenHttp: fc.Arbitrary<Buffer> = fc.oneof(
  fc.uint8Array({ minLength: 1, maxLength: 300 }).map((bytes) => Buffer.concat([Buffer.from(bytes), Buffer.from('\r\n\r\n')])),
  fc.constantFrom(
    'GET / HTTP/9.9\r\n\r\n',
    'get /v1/requests/x HTTP/1.1\r\nHost: a\r\n\r\n',
    'FOO /v1/requests/x HTTP/1.1\r\nHost: a\r\n\r\n',
    'GET /v1/requests/x\r\n\r\n',
    'GET  /v1/requests/x  HTTP/1.1\r\nHost: a\r\n\r\n',
    'GET /v1/requests/x HTTP/1.1\r\nHost a\r\n\r\n',
    'GET /v1/requests/x HTTP/1.1\r\nHo st: a\r\n\r\n',
    'GET /v1/requests/x HTTP/1.1\r\nHost: a\r\n folded: value\r\n\r\n',
    'GET /v1/requests/x HTTP/1.1\nHost: a\n\n',
    'GET /v1/requests/x HTTP/1.1\r\nHost: a\rb\r\n\r\n',
    'POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n',
    'POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!',
    'POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n',
    'POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: abc\r\n\r\n',
    'POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n',
    'POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n',
    'POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\n{"a":\r\n0\r\n\r\n',
    'GET /v1/requests/x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n',
    'GET /healthz HTTP/1.0\r\n\r\n',
    'GET /v1/requests/%zz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n',
    'GET /v1/requests/\u0000 HTTP/1.1\r\nHost: a\r\n\r\n',
    'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n',
    '\u0016\u0003\u0001\u0002\u0000\u0001\u0000\u0001\u00fc\u0003\u0003',
    'GET /v1/requests/x HTTP/1.1\r\nHost: a\r\nX-\u00ff\u00fe: v\r\n\r\n',
  ).map((text) => Buffer.from(text, 'latin1')),
  fc.integer({ min: 17_000, max: 40_000 }).map((size) => Buffer.from(`GET /v1/requests/x HTTP/1.1\r\nHost: a\r\nX-Large: ${'a'.repeat(size)}\r\n\r\n`)),
  fc.integer({ min: 90, max: 400 }).map((count) =>
    Buffer.from(`GET /v1/requests/x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n${Array.from({ length: count }, (_, i) => `X-Header-${i}: ${'v'.repeat(60)}\r\n`).join('')}\r\n`),
  ),
  fc.integer({ min: 17_000, max: 30_000 }).map((size) => Buffer.from(`GET /v1/requests/${'a'.repeat(size)} HTTP/1.1\r\nHost: a\r\n\r\n`)),
);

/** Writes the bytes on a new connection, half-closes it, and reads whatever comes back. */
function sendRaw(baseUrl: string, bytes: Buffer): Promise<RawAnswer> {
  const url = new URL(baseUrl);
  return new Promise((resolve) => {
    const socket = net.connect(Number(url.port), url.hostname);
    const chunks: Buffer[] = [];
    const finish = () => {
      clearTimeout(timer);
      socket.destroy();
      const text = Buffer.concat(chunks).toString('latin1');
      const match = /^HTTP\/1\.[01] (\d{3})[^\r\n]*\r\n([\s\S]*?)\r\n\r\n([\s\S]*)$/.exec(text);
      if (!match) {
        resolve({ status: 0, headers: new Headers(), text, body: undefined, failure: text ? 'unparseable answer' : 'closed without an answer' });
        return;
      }
      const headers = new Headers();
      for (const line of match[2]!.split('\r\n')) {
        const colon = line.indexOf(':');
        if (colon > 0) headers.append(line.slice(0, colon).trim(), line.slice(colon + 1).trim());
      }
      const length = Number(headers.get('content-length') ?? NaN);
      const bodyText = Number.isNaN(length) ? match[3]! : match[3]!.slice(0, length);
      let body: unknown = bodyText;
      try {
        body = JSON.parse(Buffer.from(bodyText, 'latin1').toString('utf8'));
      } catch {}
      resolve({ status: Number(match[1]), headers, text: bodyText, body, failure: undefined });
    };
    // An answer that is complete (its content-length read) ends the wait; so does a closed connection.
    const timer = setTimeout(finish, 3_000);
    socket.on('data', (chunk: Buffer) => {
      chunks.push(chunk);
      const text = Buffer.concat(chunks).toString('latin1');
      const head = text.indexOf('\r\n\r\n');
      const length = /\r\ncontent-length: *(\d+)/i.exec(text.slice(0, head))?.[1];
      if (head >= 0 && length !== undefined && Buffer.byteLength(text.slice(head + 4), 'latin1') >= Number(length)) finish();
    });
    socket.on('error', () => {});
    socket.on('close', finish);
    socket.end(bytes);
  });
}
