// `gateway start` on the embedded Postgres (DATABASE_URL unset), stopped by a terminal's Ctrl-C:
// the SIGINT reaches the whole foreground process group, and the embedded Postgres must not be
// in it, so that a call that finishes during the shutdown is still recorded, and the process
// exits as soon as the gateway and then the Postgres have stopped.
import { spawn } from 'node:child_process';
import { chmod, mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import t from 'tap';
import type { CreatedKey } from '../src/keys/service.ts';
import { runCliProcess } from './helpers/cli.ts';
import { clientFor, userMessage } from './helpers/http.ts';
import { childEnv, childExecArgv } from './helpers/node-child.ts';
import { freePort } from './helpers/ports.ts';
import { until } from './helpers/wait.ts';

const CLI = new URL('../src/cli.ts', import.meta.url).pathname;

t.test('Ctrl-C on gateway start with the embedded Postgres: the call in flight is recorded, then it exits 0', async (t) => {
  const dataDir = await mkdtemp(path.join(tmpdir(), 'gateway-embedded-interrupt-'));
  // Run as root, the embedded Postgres runs as a "postgres" user, which must reach its directory.
  await chmod(dataDir, 0o755);
  const port = await freePort();
  const env = { DATA_DIR: dataDir, EMBEDDED_POSTGRES_PORT: String(await freePort()), HOST: '127.0.0.1', PORT: String(port) };
  const { DATABASE_URL: _url, SECRET_ENCRYPTION_KEY: _key, SECRET_ENCRYPTION_KEYS: _keys, ...inherited } = childEnv();

  // In a process group of its own, as a terminal starts a command: a SIGINT to the group is Ctrl-C.
  const gateway = spawn(process.execPath, [...childExecArgv(), CLI, 'start'], {
    env: { ...inherited, ...env, LOG_LEVEL: 'info' },
    detached: true,
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let output = '';
  gateway.stdout.on('data', (chunk: Buffer) => (output += chunk.toString()));
  gateway.stderr.on('data', (chunk: Buffer) => (output += chunk.toString()));
  const exited = new Promise<number | null>((resolve) => gateway.on('exit', (code) => resolve(code)));
  t.teardown(async () => {
    if (gateway.exitCode === null && gateway.signalCode === null) process.kill(-gateway.pid!, 'SIGKILL');
    // An embedded Postgres left behind is stopped by the command run below (it stops one it started).
    await runCliProcess(['requests', 'list'], env);
    await rm(dataDir, { recursive: true, force: true });
  });
  await until(() => output.includes('"msg":"ready;') || gateway.exitCode !== null, () => `gateway start:\n${output}`, 60_000);
  t.equal(gateway.exitCode, null, 'gateway start is running', { output });

  const created = await runCliProcess(['keys', 'create', '--project', 'demo', '--mode', 'test', '--json'], env);
  t.equal(created.code, 0, created.stderr);
  const key = JSON.parse(created.stdout) as CreatedKey;
  const client = clientFor(`http://127.0.0.1:${port}`, key);
  const accepted = await client.post({ model: 'test-delay-3000', messages: userMessage() });
  t.equal(accepted.status, 202);
  const id = (accepted.body as { id: string }).id;
  let status = '';
  const statusOf = async () => (status = ((await client.get(id)).body as { status: string }).status);
  for (const deadline = Date.now() + 10_000; (await statusOf()) !== 'processing' && Date.now() < deadline; ) {
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  t.equal(status, 'processing', 'the call is in flight');
  const postgresPid = Number((await readFile(path.join(dataDir, 'postgres', 'postmaster.pid'), 'utf8')).split('\n')[0]);

  process.kill(-gateway.pid!, 'SIGINT');
  // It exits at all (a Postgres that waited for its clients, or a gateway that waited for
  // something other than its call, would hold it: the test's own wait ends that), exits 0, and
  // leaves no Postgres behind.
  const code = await Promise.race([exited, new Promise<'still running'>((resolve) => setTimeout(() => resolve('still running'), 60_000).unref())]);
  t.equal(code, 0, 'exits 0', { output });
  t.match(output, '"msg":"shut down cleanly"');
  t.notOk(isRunning(postgresPid), `the embedded Postgres (pid ${postgresPid}) has stopped by the time the gateway has exited`, { output });

  const shown = await runCliProcess(['requests', 'show', id, '--json'], env);
  t.equal(shown.code, 0, shown.stderr);
  t.match(JSON.parse(shown.stdout), { request: { status: 'completed' } }, 'the call that finished during the shutdown is recorded');
});

for (const [signal, what] of [['SIGTERM', 'SIGTERM to the gateway'], ['SIGINT', "Ctrl-C (SIGINT to the terminal's process group)"]] as const) {
  t.test(`${what} while gateway start is starting: its embedded Postgres is stopped with it`, async (t) => {
    const dataDir = await mkdtemp(path.join(tmpdir(), 'gateway-embedded-start-signal-'));
    await chmod(dataDir, 0o755);
    const env = { DATA_DIR: dataDir, EMBEDDED_POSTGRES_PORT: String(await freePort()), HOST: '127.0.0.1', PORT: String(await freePort()) };
    const { DATABASE_URL: _url, SECRET_ENCRYPTION_KEY: _key, SECRET_ENCRYPTION_KEYS: _keys, ...inherited } = childEnv();
    const gateway = spawn(process.execPath, [...childExecArgv(), CLI, 'start'], {
      env: { ...inherited, ...env, LOG_LEVEL: 'info' },
      detached: true,
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let output = '';
    gateway.stdout.on('data', (chunk: Buffer) => (output += chunk.toString()));
    gateway.stderr.on('data', (chunk: Buffer) => (output += chunk.toString()));
    const exited = new Promise<void>((resolve) => gateway.on('exit', () => resolve()));
    let postgresPid: number | undefined;
    t.teardown(async () => {
      if (gateway.exitCode === null && gateway.signalCode === null) process.kill(-gateway.pid!, 'SIGKILL');
      if (postgresPid !== undefined && isRunning(postgresPid)) {
        process.kill(postgresPid, 'SIGINT');
        await until(() => !isRunning(postgresPid!), 'the embedded Postgres to stop', 30_000);
      }
      await rm(dataDir, { recursive: true, force: true });
    });
    await until(() => output.includes('"msg":"embedded Postgres started"') || gateway.exitCode !== null, () => `gateway start:\n${output}`, 60_000);
    postgresPid = Number((await readFile(path.join(dataDir, 'postgres', 'postmaster.pid'), 'utf8')).split('\n')[0]);
    t.notMatch(output, '"msg":"ready;', 'the gateway is still starting');
    if (signal === 'SIGINT') process.kill(-gateway.pid!, 'SIGINT');
    else gateway.kill('SIGTERM');
    await exited;
    t.notOk(isRunning(postgresPid), `the embedded Postgres (pid ${postgresPid}) has stopped by the time the gateway has exited`, { output });
  });
}

function isRunning(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}
