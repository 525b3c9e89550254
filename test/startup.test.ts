// A gateway started while its database cannot be reached waits for it, and starts once it can.
import { randomBytes } from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { runCli, runCliProcess } from './helpers/cli.ts';
import { createTestDatabase } from './helpers/database.ts';
import { freePort } from './helpers/ports.ts';
import { spawnServe } from './helpers/serve.ts';
import { startTcpProxy } from './helpers/tcp-proxy.ts';
import type { Teardown } from './helpers/teardown.ts';
import { until } from './helpers/wait.ts';

for (const role of ['api', 'worker'] as const) {
  t.test(`gateway serve --role ${role} started while the database is unreachable waits for it, and starts once it answers`, async (t) => {
    const url = await createTestDatabase(t);
    const proxy = await startTcpProxy(t, url);
    proxy.cut();
    const port = await freePort();
    const gateway = spawnServe(
      t,
      {
        DATABASE_URL: proxy.url,
        SECRET_ENCRYPTION_KEY: randomBytes(32).toString('base64'),
        PORT: String(port),
        HOST: '127.0.0.1',
        LOG_LEVEL: 'info',
      },
      ['--role', role],
    );
    await until(() => gateway.entries().some((entry) => entry.msg === 'database unavailable at start; waiting for it'), 'the gateway to say it waits', 15_000);
    await sleep(1_500);
    t.ok(gateway.running, 'it waits, still running, while the database cannot be reached');
    t.notOk(gateway.entries().some((entry) => entry.msg === 'gateway started'), 'and has not started');

    proxy.restore();
    await until(() => gateway.entries().some((entry) => entry.msg === 'gateway started'), 'the gateway to start', 15_000);
    const ready = await fetch(`http://127.0.0.1:${port}/readyz`);
    t.equal(ready.status, 200, 'then it serves, ready');
    gateway.signal('SIGTERM');
    t.match(await gateway.exited(), { code: 0 }, 'and stops cleanly');
  });
}

t.test('gateway serve stops at once for a database that refuses it for a reason of its own', async (t) => {
  const url = new URL(await createTestDatabase(t));
  url.pathname = '/gateway_no_such_database';
  const gateway = spawnServe(t, {
    DATABASE_URL: url.toString(),
    SECRET_ENCRYPTION_KEY: randomBytes(32).toString('base64'),
    PORT: String(await freePort()),
    HOST: '127.0.0.1',
  }, ['--role', 'api']);
  const exit = await gateway.exited();
  t.not(exit.code, 0, 'it exits with an error');
  t.match(gateway.output(), /gateway_no_such_database/, 'saying which database');
  t.notOk(gateway.entries().some((entry) => entry.msg === 'database unavailable at start; waiting for it'), 'without waiting for it');
});

/** `gateway serve --role <role>` on `url`, and how it exited, if it did within 20 s. */
async function serveFor20Seconds(t: Teardown, url: URL, role: 'api' | 'worker') {
  const gateway = spawnServe(t, {
    DATABASE_URL: url.toString(),
    SECRET_ENCRYPTION_KEY: randomBytes(32).toString('base64'),
    PORT: String(await freePort()),
    HOST: '127.0.0.1',
    LOG_LEVEL: 'info',
  }, ['--role', role]);
  const exit = await Promise.race([gateway.exited(), sleep(20_000).then(() => undefined)]);
  return { gateway, exit };
}

for (const role of ['api', 'worker'] as const) {
  t.test(`gateway serve --role ${role} stops at once, saying why, for a connection the database will never take: TLS it does not have`, async (t) => {
    const url = new URL(await createTestDatabase(t));
    url.searchParams.set('sslmode', 'require');
    const { gateway, exit } = await serveFor20Seconds(t, url, role);
    t.ok(exit, 'it exits within 20 s');
    t.not(exit?.code, 0, 'with an error');
    t.match(gateway.output(), /The server does not support SSL connections/, 'saying why');
    t.notOk(gateway.entries().some((entry) => entry.msg === 'database unavailable at start; waiting for it'), 'without waiting for it');
  });
}

t.test('gateway migrate stops at once, saying why, for TLS the database does not have', async (t) => {
  const url = new URL(await createTestDatabase(t));
  url.searchParams.set('sslmode', 'require');
  const result = await runCli(['migrate'], { DATABASE_URL: url.toString() });
  t.equal(result.code, 1, 'it fails');
  t.match(result.stderr, /The server does not support SSL connections/, 'saying why');
  t.equal(result.stderr.trim().split('\n').length, 1, 'in one line, no stack');
});

t.test('gateway serve stops at once, saying why, for a DATABASE_URL whose certificate file cannot be read', async (t) => {
  const url = new URL(await createTestDatabase(t));
  url.searchParams.set('sslmode', 'verify-full');
  url.searchParams.set('sslrootcert', '/nonexistent/root.crt');
  const { gateway, exit } = await serveFor20Seconds(t, url, 'worker');
  t.ok(exit, 'it exits within 20 s', { output: gateway.output() });
  t.equal(exit?.code, 1, 'with code 1');
  t.notOk(gateway.entries().some((entry) => entry.msg === 'database unavailable at start; waiting for it'), 'without taking the file for the database out of reach');
  t.match(gateway.output(), "DATABASE_URL names a file that cannot be read: ENOENT: no such file or directory, open '/nonexistent/root.crt'", 'saying which file');
});

t.test('an administrative command says in one line that a file DATABASE_URL names cannot be read, or that its port is out of range', async (t) => {
  const url = new URL(await createTestDatabase(t));
  const withParams = (params: Record<string, string>) => {
    const target = new URL(url);
    for (const [name, value] of Object.entries(params)) target.searchParams.set(name, value);
    return target.toString();
  };
  const noCertificate = await runCli(['migrate'], { DATABASE_URL: withParams({ sslcert: '/nonexistent/client.crt', sslkey: '/nonexistent/client.key' }) });
  t.equal(noCertificate.code, 1);
  t.equal(
    noCertificate.stderr,
    "Invalid settings:\n  DATABASE_URL names a file that cannot be read: ENOENT: no such file or directory, open '/nonexistent/client.crt'\n",
  );
  // As a process: pg's pool never ended after such a connection, and the process stopped with
  // code 13 (a top-level await left unsettled), having said nothing of why.
  for (const port of ['abc', '70000']) {
    const badPort = await runCliProcess(['stats'], { DATABASE_URL: withParams({ port }) });
    t.equal(badPort.code, 1, `port=${port}: code 1`);
    t.equal(badPort.stderr, 'Invalid settings:\n  DATABASE_URL\'s port must be a whole number from 1 to 65535\n', `port=${port}`);
  }
});

for (const role of ['api', 'worker'] as const) {
  t.test(`gateway serve --role ${role} stops at once, saying why, for a HOST that does not resolve`, async (t) => {
    const gateway = spawnServe(t, {
      DATABASE_URL: await createTestDatabase(t),
      SECRET_ENCRYPTION_KEY: randomBytes(32).toString('base64'),
      PORT: String(await freePort()),
      HOST: 'gateway-no-such-host.invalid',
      LOG_LEVEL: 'info',
    }, ['--role', role]);
    const exit = await Promise.race([gateway.exited(), sleep(20_000).then(() => undefined)]);
    t.ok(exit, 'it exits within 20 s', { output: gateway.output() });
    t.equal(exit?.code, 1, 'with code 1');
    const said = gateway.lines.filter((line) => !line.startsWith('{'));
    t.equal(said.length, 1, 'in one line, no stack', { said });
    t.match(said[0], /^Cannot listen on HOST gateway-no-such-host\.invalid/, 'saying why');
    t.notOk(gateway.entries().some((entry) => entry.msg === 'database unavailable at start; waiting for it'), 'without taking it for the database');
  });
}

t.test('gateway serve --role worker started while the database is unreachable leaves nothing running of the starts that failed', async (t) => {
  const url = await createTestDatabase(t);
  const proxy = await startTcpProxy(t, url);
  proxy.cut();
  const gateway = spawnServe(t, {
    DATABASE_URL: proxy.url,
    SECRET_ENCRYPTION_KEY: randomBytes(32).toString('base64'),
    PORT: String(await freePort()),
    HOST: '127.0.0.1',
    LOG_LEVEL: 'info',
  }, ['--role', 'worker']);
  await until(() => gateway.entries().some((entry) => entry.msg === 'database unavailable at start; waiting for it'), 'the gateway to say it waits', 15_000);
  // Longer than the webhook deliverer's look for forgotten tries (10 s): one left running by a
  // start that failed would look, on the pool that start closed.
  await sleep(12_000);
  proxy.restore();
  await until(() => gateway.entries().some((entry) => entry.msg === 'gateway started'), 'the gateway to start', 15_000);
  const leftOver = gateway.entries().filter((entry) => entry.msg === 'could not look for webhook tries lost track of');
  t.same(leftOver, [], 'no deliverer of a failed start looks for its tries on a closed pool');
  gateway.signal('SIGTERM');
  t.match(await gateway.exited(), { code: 0 }, 'and it stops cleanly');
});
