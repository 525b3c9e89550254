// `gateway start` on the embedded Postgres (DATABASE_URL unset) stops that Postgres when it stops:
// a second `gateway start` on the same DATA_DIR would serve on a database that goes with the
// first, so it refuses to start; the administrative commands use that Postgres while it runs.
import { chmod, mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import t from 'tap';
import type { CreatedKey } from '../src/keys/service.ts';
import { runCliProcess } from './helpers/cli.ts';
import { clientFor, userMessage } from './helpers/http.ts';
import { childEnv, childExecArgv } from './helpers/node-child.ts';
import { freePort } from './helpers/ports.ts';
import { GatewayProcess } from './helpers/serve.ts';
import { until } from './helpers/wait.ts';

t.test('a second gateway start on the DATA_DIR of a running one exits 1, naming the process that runs its Postgres; the first serves on', async (t) => {
  const dataDir = await mkdtemp(path.join(tmpdir(), 'gateway-embedded-second-start-'));
  // Run as root, the embedded Postgres runs as a "postgres" user, which must reach its directory.
  await chmod(dataDir, 0o755);
  const env = { DATA_DIR: dataDir, EMBEDDED_POSTGRES_PORT: String(await freePort()), HOST: '127.0.0.1' };
  const { DATABASE_URL: _url, SECRET_ENCRYPTION_KEY: _key, SECRET_ENCRYPTION_KEYS: _keys, ...inherited } = childEnv();
  const gateway = (label: string) =>
    new GatewayProcess({ label, command: 'start', args: [], env: { ...inherited, ...env, PORT: '0', LOG_LEVEL: 'info' }, nodeArgs: childExecArgv() });
  const first = gateway('first');
  const second = gateway('second');
  let serve: GatewayProcess | undefined;
  t.teardown(async () => {
    await serve?.stop();
    await second.stop();
    await first.stop();
    // An embedded Postgres left running (a gateway killed) is stopped by a command, which takes it over.
    await runCliProcess(['requests', 'list'], env);
    await rm(dataDir, { recursive: true, force: true });
  });

  await first.start(60_000);
  const created = await runCliProcess(['keys', 'create', '--project', 'demo', '--mode', 'test', '--json'], env);
  t.equal(created.code, 0, 'a command uses the running Postgres', { stderr: created.stderr });
  const key = JSON.parse(created.stdout) as CreatedKey;

  second.spawn();
  await until(() => !second.running || second.output().includes('"msg":"gateway started"'), () => `second gateway:\n${second.output()}`, 60_000);
  const exit = second.running ? undefined : await second.exited();
  t.equal(exit?.code, 1, 'the second gateway does not serve: it exits 1', { output: second.output() });
  const said = second.lines.filter((line) => !line.startsWith('{'));
  t.equal(said.length, 1, 'it says why in one line', { said });
  const postgresJson = path.join(dataDir, 'postgres.json');
  t.match(said[0], `is run by another gateway (pid ${first.pid})`, 'naming the process that runs the embedded Postgres');
  t.match(said[0], `DATABASE_URL=postgres://<user>:<password>@127.0.0.1:${env.EMBEDDED_POSTGRES_PORT}/postgres (its user and password are in ${postgresJson})`, 'and how to run more processes on it');

  // As that line says: a `gateway serve` with DATABASE_URL set to the embedded Postgres, and the key the first generated.
  const { user, password } = JSON.parse(await readFile(postgresJson, 'utf8')) as { user: string; password: string };
  const secret = (await readFile(path.join(dataDir, 'secret-encryption-key'), 'utf8')).trim();
  serve = new GatewayProcess({
    label: 'serve',
    args: [],
    env: {
      ...inherited,
      DATABASE_URL: `postgres://${user}:${password}@127.0.0.1:${env.EMBEDDED_POSTGRES_PORT}/postgres`,
      SECRET_ENCRYPTION_KEY: secret,
      HOST: '127.0.0.1',
      PORT: '0',
      LOG_LEVEL: 'info',
    },
    nodeArgs: childExecArgv(),
  });
  await serve.start(60_000);

  for (const gateway of [first, serve]) {
    const client = clientFor(gateway.url!, key);
    const accepted = await client.post({ model: 'gpt-4o-mini', messages: userMessage() });
    t.equal(accepted.status, 202, `${gateway.label} takes a call`);
    const id = (accepted.body as { id: string }).id;
    let status = '';
    await until(async () => (status = ((await client.get(id)).body as { status: string }).status) === 'completed', () => `${gateway.label}'s call: ${status}`, 30_000);
  }
});
