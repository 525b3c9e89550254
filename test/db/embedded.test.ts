// The embedded Postgres (DATABASE_URL unset): a cluster under a directory, started by the process
// that needs it, or used as it is when it is already running there.
import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { chmod, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { Writable } from 'node:stream';
import pg from 'pg';
import t, { type Test } from 'tap';
import { startEmbeddedPostgres, type EmbeddedOptions } from '../../src/db/embedded.ts';
import { createLogger } from '../../src/logger.ts';
import { childEnv, childExecArgv } from '../helpers/node-child.ts';
import { freePort } from '../helpers/ports.ts';
import { until } from '../helpers/wait.ts';

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

/**
 * A process of its own that starts the embedded Postgres with these options, as an administrative
 * command does (it stops that Postgres at its end, or at a SIGTERM); resolved once it has.
 */
async function startedInAnotherProcess(options: Omit<EmbeddedOptions, 'logger'>): Promise<ChildProcess> {
  const embedded = new URL('../../src/db/embedded.ts', import.meta.url).href;
  const logging = new URL('../../src/logger.ts', import.meta.url).href;
  const script = `
    const { startEmbeddedPostgres } = await import(${JSON.stringify(embedded)});
    const { createLogger } = await import(${JSON.stringify(logging)});
    await startEmbeddedPostgres({ ...${JSON.stringify(options)}, logger: createLogger({ logLevel: 'silent' }) });
    console.log('ready');
    setInterval(() => {}, 1000);
  `;
  const child = spawn(process.execPath, [...childExecArgv(), '--input-type=module', '-e', script], { env: childEnv(), stdio: ['ignore', 'pipe', 'inherit'] });
  const [line] = (await once(child.stdout!, 'data')) as [Buffer];
  if (line.toString().trim() !== 'ready') throw new Error(`the other process said: ${line.toString()}`);
  return child;
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
  const first = await startedInAnotherProcess(options);
  first.kill('SIGKILL');
  await once(first, 'exit');

  const second = await startEmbeddedPostgres(options);
  t.ok(await answers(second.url), 'the next start uses the Postgres left running');
  second.shutdownHandled();
  await second.stop();
  t.notOk(await answers(second.url), 'and its stop stops it');
});

t.test('a Postgres started by an administrative command that does not end: a gateway start gives up waiting, saying why', async (t) => {
  const { logger: _silent, ...options } = await clusterOptions(t, 'hung-command');
  const command = await startedInAnotherProcess(options);
  // SIGTERM: the command stops its Postgres, then exits.
  t.teardown(async () => {
    command.kill('SIGTERM');
    if (command.exitCode === null) await once(command, 'exit');
  });

  await t.rejects(
    startEmbeddedPostgres({ ...options, logger, serves: true, commandWaitMs: 500 }),
    { name: 'EmbeddedPostgresError', message: new RegExp(`started by a command \\(pid ${command.pid}\\) still running after 0\\.5 s`) },
  );
  t.equal(command.exitCode, null, 'the command and its Postgres are left alone');
});

t.test('a Postgres an administrative command started: a gateway start waits for the command to stop it, then starts its own', async (t) => {
  const { logger: _silent, ...options } = await clusterOptions(t, 'command');
  const command = await startedInAnotherProcess(options);
  t.teardown(() => command.kill('SIGKILL'));
  const logs: string[] = [];
  const sink = new Writable({
    write(chunk: Buffer, _encoding, done) {
      logs.push(chunk.toString());
      done();
    },
  });
  const logger = createLogger({ logLevel: 'info' }, sink);

  let resolved = false;
  const starting = startEmbeddedPostgres({ ...options, logger, serves: true }).finally(() => (resolved = true));
  await until(() => resolved || logs.some((line) => line.includes(`"owner":${command.pid}`)), 'the start to find the command\'s Postgres', 30_000);
  // The command ends (SIGTERM: it stops its Postgres, then exits).
  command.kill('SIGTERM');
  await once(command, 'exit');

  const gateway = await starting;
  t.teardown(() => gateway.stop());
  t.ok(await answers(gateway.url), 'the Postgres the start gives answers once the command has ended', { logs });
});
