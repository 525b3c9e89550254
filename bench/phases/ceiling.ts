// The ceiling of the naive design, in the same run and on the same server: pgbench, 8 clients,
// each transaction inserting one request row (a new valid id, the benchmark's project and key)
// and calling graphile_worker.add_job for it (a dispatch of a lane), as the gateway's accept
// path does for a request alone in its statement. No gateway process runs meanwhile, so no
// worker takes the jobs: afterwards there must be exactly as many jobs as rows.
import { execFile, spawn } from 'node:child_process';
import { writeFile } from 'node:fs/promises';
import path from 'node:path';
import { promisify } from 'node:util';
import pg from 'pg';
import { cpuLine, type PhaseContext, type PhaseResult } from '../context.ts';
import { BENCH_APPLICATION_NAME } from '../postgres.ts';
import { completionBody, rate } from './common.ts';

const PGBENCH_CANDIDATES = ['pgbench', '/usr/bin/pgbench', '/usr/lib/postgresql/15/bin/pgbench'];

export async function ceilingPhase(ctx: PhaseContext): Promise<PhaseResult> {
  const { warmupMs, durationMs, pgbenchClients } = ctx.settings;
  const key = await ctx.query(async (client) => {
    const { rows } = await client.query<{ id: string; project_id: string }>('select id, project_id from gateway.api_keys');
    if (rows.length !== 1) throw new Error(`expected the one benchmark key, found ${rows.length}`);
    return rows[0]!;
  });
  const body = completionBody({ wait: false }).replace(',"wait":false', '');
  const pgbench = await findPgbench();
  const measure = async (name: string, statement: string, ms: number) => {
    if (!pgbench) return { tps: (await nodeEquivalent(ctx.databaseUrl, statement, pgbenchClients, ms)) / (ms / 1000), failed: 0 };
    const script = path.join(ctx.run.runDir, `${name}.sql`);
    await writeFile(script, `${statement}\n`);
    const output = await run(pgbench.path, [
      '--no-vacuum',
      `--client=${pgbenchClients}`,
      '--jobs=2',
      `--time=${Math.max(1, Math.round(ms / 1000))}`,
      '--protocol=prepared',
      `--file=${script}`,
      ctx.databaseUrl,
    ]);
    const match = /tps = ([\d.]+) \(without initial connection time\)/.exec(output);
    if (!match) throw new Error(`could not read tps from pgbench's output:\n${output}`);
    return { tps: Number(match[1]), failed: Number(/number of failed transactions: (\d+)/.exec(output)?.[1] ?? 0) };
  };

  const statement = oneRequest(key.project_id, key.id, body);
  if (warmupMs > 0) await measure('ceiling', statement, warmupMs);
  const meter = ctx.cpuMeter();
  const { tps, failed } = await measure('ceiling', statement, durationMs);
  const cpu = await meter.end();

  const stored = await ctx.storedCounts();
  const consistent = stored.requests === stored.jobs && stored.requests > 0;

  // Two shorter runs for reference, after the check above (the first adds rows without jobs):
  // the same insert without its job, and grouped: 50 rows and one add_jobs per transaction.
  const insertOnly = await measure('ceiling-insert-only', oneRequest(key.project_id, key.id, body, false), REFERENCE_MS);
  const grouped = await measure('ceiling-grouped', groupedRequests(key.project_id, key.id, body, GROUP), REFERENCE_MS);

  const tool = pgbench
    ? `${pgbench.version}, ${pgbenchClients} clients, 2 threads, prepared statements`
    : `pgbench NOT FOUND: a Node script (node-postgres, ${pgbenchClients} connections) stood in for it`;
  return {
    rows: [
      {
        figure: `ceiling: ${pgbench ? 'pgbench' : 'Node stand-in for pgbench'}, insert + add_job (${pgbenchClients} clients)`,
        result: `${rate(tps)} tps`,
        target: '(reference)',
      },
    ],
    details: [
      `${tool}; one statement, so one transaction, per request: ${statement.replace(/\s+/g, ' ')}`,
      cpuLine(cpu, tps),
      `stored: ${stored.requests.toLocaleString('en-US')} requests, ${stored.jobs.toLocaleString('en-US')} jobs (warm-up included)` +
        (consistent ? '; no job was taken by a worker' : '  ** MISMATCH: a worker ran jobs, or transactions failed **'),
      ...(failed > 0 ? [`** ${failed} pgbench transactions failed **`] : []),
      `for reference (${REFERENCE_MS / 1000} s each): the same insert without add_job ${rate(insertOnly.tps)} tps; ` +
        `${GROUP} rows and one add_jobs per transaction ${rate(grouped.tps * GROUP)} requests/s (${rate(grouped.tps)} tps)`,
    ],
    data: {
      tps,
      tool: pgbench?.version ?? 'node stand-in',
      clients: pgbenchClients,
      failed,
      stored,
      insertOnlyTps: insertOnly.tps,
      groupedRequestsPerSecond: grouped.tps * GROUP,
      cpu: cpu.cores,
    },
  };
}

const REFERENCE_MS = 5_000;
const GROUP = 50;
const literal = (text: string) => `'${text.replaceAll("'", "''")}'`;

/** One request row with a fresh valid id (req_ + 32 hex digits), and (unless told) its job. */
function oneRequest(projectId: string, keyId: string, body: string, withJob = true): string {
  const insert = `insert into gateway.requests (id, project_id, mode, api_key_id, model, body, body_sha256)
  values ('req_' || md5(random()::text || clock_timestamp()::text), ${Number(projectId)}, 'test', ${literal(keyId)},
          'test-echo', ${literal(body)}, sha256(convert_to(${literal(body)}, 'UTF8')))`;
  if (!withJob) return `${insert};`;
  return `with request as (
  ${insert}
  returning id
)
select graphile_worker.add_job('dispatch_queue', json_build_object('queue_id', 0))
from request;`;
}

/** `count` request rows and one add_jobs call for all their jobs. */
function groupedRequests(projectId: string, keyId: string, body: string, count: number): string {
  return `with request as (
  insert into gateway.requests (id, project_id, mode, api_key_id, model, body, body_sha256)
  select 'req_' || md5(random()::text || clock_timestamp()::text || n), ${Number(projectId)}, 'test', ${literal(keyId)},
         'test-echo', ${literal(body)}, sha256(convert_to(${literal(body)}, 'UTF8'))
  from generate_series(1, ${count}) as n
  returning id
)
select graphile_worker.add_jobs(array_agg(json_populate_record(null::graphile_worker.job_spec,
  json_build_object('identifier', 'dispatch_queue', 'payload', json_build_object('queue_id', 0)))))
from request;`;
}

async function findPgbench(): Promise<{ path: string; version: string } | undefined> {
  for (const candidate of PGBENCH_CANDIDATES) {
    try {
      const { stdout } = await promisify(execFile)(candidate, ['--version']);
      return { path: candidate, version: stdout.trim() };
    } catch {
      // not this one
    }
  }
  return undefined;
}

function run(command: string, args: string[]): Promise<string> {
  return new Promise((resolve, reject) => {
    const child = spawn(command, args, { stdio: ['ignore', 'pipe', 'pipe'] });
    let output = '';
    child.stdout.on('data', (chunk: Buffer) => (output += chunk.toString()));
    child.stderr.on('data', (chunk: Buffer) => (output += chunk.toString()));
    child.once('error', reject);
    child.once('exit', (code) => (code === 0 ? resolve(output) : reject(new Error(`pgbench exited with ${code}:\n${output}`))));
  });
}

/** The same transaction in a loop on `clients` connections for `durationMs`; returns how many committed. */
async function nodeEquivalent(url: string, statement: string, clients: number, durationMs: number): Promise<number> {
  const end = performance.now() + durationMs;
  let committed = 0;
  await Promise.all(
    Array.from({ length: clients }, async () => {
      const client = new pg.Client({ connectionString: url, application_name: BENCH_APPLICATION_NAME });
      await client.connect();
      try {
        while (performance.now() < end) {
          await client.query({ name: 'ceiling', text: statement });
          if (performance.now() < end) committed++;
        }
      } finally {
        await client.end();
      }
    }),
  );
  return committed;
}
