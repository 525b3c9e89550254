// The floor under the wait=true overhead on this machine: a server that does only what any
// gateway that commits to Postgres must do for a wait=true request (one flushed commit storing
// the request, the call, one flushed commit storing the result, then the answer), with a 50 ms
// timer for the call as the simulator's test-delay-50 has, driven by the wait phase's own load
// generator at its two rates. What `make bench` measures above these figures is the gateway's own.
//
//   DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres node bench/floor.ts
//
// FLOOR_FLUSHES=1: the insert's commit does not wait for its flush (synchronous_commit off for its
// transaction), and the finish's flush carries the insert's WAL with it: the floor of a server
// that flushes once per request.
//
// The server runs in a process of its own (this file, with `serve`), on a database of its own,
// dropped at the end. DATABASE_URL unset: the benchmark's embedded cluster under .data/.
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import http from 'node:http';
import { once } from 'node:events';
import path from 'node:path';
import pg from 'pg';
import { freePort } from '../scripts/ports.ts';
import { checks, openLoop } from './load.ts';
import { openServer } from './postgres.ts';

const CALL_MS = 50;
const RATES = [20, 200];
const FLUSHES = Number(process.env.FLOOR_FLUSHES ?? 2);
if (FLUSHES !== 1 && FLUSHES !== 2) throw new Error(`FLOOR_FLUSHES: 1 or 2, not ${process.env.FLOOR_FLUSHES}`);
const WARMUP_MS = 3_000;
const DURATION_MS = Number(process.env.BENCH_DURATION ?? 10) * 1000;
const BODY = JSON.stringify({ model: 'test-delay-50', messages: [{ role: 'user', content: 'How far down is the floor?' }], wait: true });
const ANSWER = JSON.stringify({ object: 'chat.completion', choices: [{ index: 0, message: { role: 'assistant', content: 'Here.' } }] });

if (process.argv[2] === 'serve') await serve(Number(process.argv[3]), process.argv[4]!);
else await measure();

/** The insert; with one flush, its transaction commits without waiting for it (as a claim of the gateway's does). */
const STORE =
  FLUSHES === 2
    ? 'insert into floor_requests (body) values ($1) returning id'
    : "with stored as (insert into floor_requests (body) values ($1) returning id) select id from stored cross join (select set_config('synchronous_commit', 'off', true)) as commit_without_flush";

async function serve(port: number, url: string): Promise<void> {
  const pool = new pg.Pool({ connectionString: url, max: 4 });
  await pool.query('create table floor_requests (id bigserial primary key, body json not null, result json)');
  const server = http.createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (chunk: Buffer) => chunks.push(chunk));
    req.on('end', async () => {
      try {
        const { rows } = await pool.query<{ id: string }>({
          name: 'store',
          text: STORE,
          values: [Buffer.concat(chunks).toString()],
        });
        await new Promise((resolve) => setTimeout(resolve, CALL_MS));
        await pool.query({ name: 'finish', text: 'update floor_requests set result = $2 where id = $1', values: [rows[0]!.id, ANSWER] });
        res.writeHead(200, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(ANSWER) });
        res.end(ANSWER);
      } catch (error) {
        res.writeHead(500).end(String(error));
      }
    });
  });
  server.listen(port, '127.0.0.1', () => process.stdout.write('listening\n'));
  process.on('SIGTERM', () => server.close(() => pool.end().then(() => process.exit(0))));
}

async function measure(): Promise<void> {
  const postgres = await openServer(process.env.DATABASE_URL, path.resolve('.data'));
  const database = `bench_floor_${randomBytes(4).toString('hex')}`;
  await postgres.createDatabase(database);
  const port = await freePort();
  const child = spawn(process.execPath, [import.meta.filename, 'serve', String(port), postgres.urlFor(database)], {
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  try {
    await once(child.stdout!, 'data');
    const request = `POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(BODY)}\r\n\r\n${BODY}`;
    for (const rate of RATES) {
      const result = await openLoop({
        port,
        rate,
        warmupMs: WARMUP_MS,
        durationMs: DURATION_MS,
        initialConnections: Math.ceil((rate * (CALL_MS + 50)) / 1000) + 4,
        drainTimeoutMs: 60_000,
        request: () => request,
        check: checks.status(200, '"object":"chat.completion"'),
      });
      const overhead = (p: number) => `${(result.latency.percentile(p) - CALL_MS).toFixed(2)} ms`;
      console.log(
        `floor${FLUSHES === 1 ? ' (one flush)' : ''} at ${rate} req/s: ${result.ok} answered correctly, ${result.totalErrors} not; overhead (latency minus ${CALL_MS} ms) ` +
          `min ${overhead(0)}, p50 ${overhead(50)}, p90 ${overhead(90)}, p99 ${overhead(99)}`,
      );
    }
  } finally {
    child.kill('SIGTERM');
    await once(child, 'exit');
    await postgres.dropDatabase(database);
    await postgres.stop();
  }
}
