// The embedded Postgres (DATABASE_URL unset): a cluster under a directory, started by the process
// that needs it, or used as it is when it is already running there.
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { chmod, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import pg from 'pg';
import t, { type Test } from 'tap';
import { startEmbeddedPostgres } from '../../src/db/embedded.ts';
import { createLogger } from '../../src/logger.ts';
import { childEnv, childExecArgv } from '../helpers/node-child.ts';
import { freePort } from '../helpers/ports.ts';

const logger = createLogger({ logLevel: 'silent' });

async function answers(url: string): Promise<boolean> {
  const client = new pg.Client({ connectionString: url, connectionTimeoutMillis: 5_000 });
  client.on('error', () => {});
  try {
    await client.connect();
    await client.query('select 1');
    return true;
  } catch {
    return false;
  } finally {
    await client.end().catch(() => {});
  }
}

/** Options of an embedded Postgres in a directory of its own, removed at the test's end. */
async function clusterOptions(t: Test, name: string) {
  const dataDir = await mkdtemp(path.join(tmpdir(), `gateway-embedded-${name}-`));
  // Run as root, the embedded Postgres runs as a "postgres" user, which must reach its directory.
  await chmod(dataDir, 0o755);
  t.teardown(() => rm(dataDir, { recursive: true, force: true }));
  return { directory: path.join(dataDir, 'postgres'), port: await freePort(), logger, durable: false };
}

t.test('a postmaster.pid left by a Postgres that was killed, naming a process that is alive but no Postgres: a start starts its own', async (t) => {
  const options = await clusterOptions(t, 'stale');
  const { directory } = options;
  const first = await startEmbeddedPostgres(options);
  const lockFile = path.join(directory, 'postmaster.pid');
  const lock = await readFile(lockFile, 'utf8');
  await first.stop();
  // As after a container's restart: the lock file of a Postgres that did not stop, whose pid is
  // now another process's (here this test's, the parent of the next Postgres, which Postgres
  // itself takes for a stale lock).
  await writeFile(lockFile, [String(process.pid), ...lock.split('\n').slice(1)].join('\n'));

  const second = await startEmbeddedPostgres(options);
  t.teardown(() => second.stop());
  t.ok(await answers(second.url), 'the Postgres it gives answers');
});

t.test('a Postgres left running by a process that was killed: the next start takes it over, and stops it as one it started', async (t) => {
  const options = await clusterOptions(t, 'orphan');
  const { directory } = options;
  // Whatever is left running at the end is stopped (its postmaster.pid names it).
  t.teardown(async () => {
    const pid = Number((await readFile(path.join(directory, 'postmaster.pid'), 'utf8').catch(() => '')).split('\n')[0]);
    if (pid > 0) process.kill(pid, 'SIGINT');
  });

  // A process that starts the embedded Postgres and is killed (SIGKILL: no exit hook runs).
  const embedded = new URL('../../src/db/embedded.ts', import.meta.url).href;
  const logging = new URL('../../src/logger.ts', import.meta.url).href;
  const script = `
    const { startEmbeddedPostgres } = await import(${JSON.stringify(embedded)});
    const { createLogger } = await import(${JSON.stringify(logging)});
    await startEmbeddedPostgres({ ...${JSON.stringify(options)}, logger: createLogger({ logLevel: 'silent' }) });
    console.log('ready');
    setInterval(() => {}, 1000);
  `;
  const first = spawn(process.execPath, [...childExecArgv(), '--input-type=module', '-e', script], { env: childEnv(), stdio: ['ignore', 'pipe', 'inherit'] });
  const [line] = (await once(first.stdout!, 'data')) as [Buffer];
  t.equal(line.toString().trim(), 'ready', 'the first process started the embedded Postgres');
  first.kill('SIGKILL');
  await once(first, 'exit');

  const second = await startEmbeddedPostgres(options);
  t.ok(await answers(second.url), 'the next start uses the Postgres left running');
  second.shutdownHandled();
  await second.stop();
  t.notOk(await answers(second.url), 'and its stop stops it');
});
