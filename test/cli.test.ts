// The gateway command line (docs/cli.md) against a database; its exit codes and streams also as a
// process of its own.
import { createHash, randomBytes } from 'node:crypto';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import net from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';
import pg from 'pg';
import t from 'tap';
import { listMigrations } from '../src/db/migrate.ts';
import { mayBeIssuedApiKey, randomBase62 } from '../src/ids.ts';
import { runCli, runCliProcess } from './helpers/cli.ts';
import { adminQuery, createTestDatabase, urlForDatabase } from './helpers/database.ts';
import { startTestGateway } from './helpers/gateway.ts';
import { clientFor, userMessage, type Answer } from './helpers/http.ts';
import { storeKnownKey } from './helpers/keys.ts';
import { freePort } from './helpers/ports.ts';
import { waitFor } from './helpers/wait.ts';

async function adminRows(url: string, query: string): Promise<Record<string, unknown>[]> {
  let rows: Record<string, unknown>[] = [];
  await adminQuery(url, async (client) => {
    rows = (await client.query(query)).rows;
  });
  return rows;
}

/** An empty database (not cloned from the migrated template). */
async function emptyDatabase(t: Parameters<typeof createTestDatabase>[0]) {
  const adminUrl = process.env.GATEWAY_TEST_ADMIN_URL!;
  const name = `gateway_test_empty_${randomBytes(6).toString('hex')}`;
  await adminQuery(adminUrl, async (admin) => {
    await admin.query(`create database ${name}`);
  });
  t.teardown(() =>
    adminQuery(adminUrl, async (admin) => {
      await admin.query(`drop database if exists ${name} with (force)`);
    }),
  );
  return urlForDatabase(adminUrl, name);
}

t.test('migrate builds the schema, twice at once, and again with nothing left to do', async (t) => {
  const url = await emptyDatabase(t);
  const [first, second] = await Promise.all([
    runCli(['migrate'], { DATABASE_URL: url }),
    runCli(['migrate'], { DATABASE_URL: url }),
  ]);
  t.equal(first.code, 0, first.stderr);
  t.equal(second.code, 0, second.stderr);
  const again = await runCli(['migrate'], { DATABASE_URL: url });
  t.equal(again.code, 0);
  t.match(again.stdout, /up to date/);

  const client = new pg.Client({ connectionString: url });
  await client.connect();
  t.teardown(() => client.end());
  const { rows } = await client.query('select id from gateway.migrations order by id');
  t.same(rows.map((row) => row.id), (await listMigrations()).map((migration) => migration.id));
  const tables = await client.query(
    `select table_schema || '.' || table_name as name from information_schema.tables
     where table_schema in ('gateway', 'graphile_worker') and table_type = 'BASE TABLE' order by 1`,
  );
  t.ok(tables.rows.some((row) => row.name === 'graphile_worker._private_jobs'), 'graphile-worker migrated too');
  t.same(
    tables.rows.filter((row) => row.name.startsWith('gateway.')).map((row) => row.name),
    [
      'gateway.api_keys',
      'gateway.intake_counters',
      'gateway.lane_fair_shares',
      'gateway.lanes',
      'gateway.migrations',
      'gateway.projects',
      'gateway.queues',
      'gateway.request_attempts',
      'gateway.requests',
      'gateway.retention_cursors',
      'gateway.signature_nonces',
      'gateway.webhook_deliveries',
      'gateway.webhook_endpoints',
      'gateway.webhook_messages',
      'gateway.worker_pools',
    ],
  );
});

t.test('keys create, list and revoke', async (t) => {
  const service = await startTestGateway(t, { role: 'api' });
  const env = {
    DATABASE_URL: service.databaseUrl,
    SECRET_ENCRYPTION_KEY: service.config.secretEncryptionKeys[0]!.toString('base64'),
  };

  const created = await runCli(['keys', 'create', '--project', 'acme', '--mode', 'test', '--json'], env);
  t.equal(created.code, 0, created.stderr);
  const key = JSON.parse(created.stdout);
  t.same(Object.keys(key), ['id', 'project', 'mode', 'api_key', 'signing_secret']);
  t.match(key.id, /^key_[A-Za-z0-9]{20,40}$/, 'the id, to revoke it by');
  t.equal(key.project, 'acme');
  t.equal(key.mode, 'test');
  t.match(key.api_key, /^svc_test_[A-Za-z0-9]{46}$/, '40 random characters and a checksum of 6');
  t.ok(mayBeIssuedApiKey(key.api_key), 'the key passes its own checksum');
  t.match(key.signing_secret, /^svc_sig_[A-Za-z0-9]{32,}$/);

  const human = await runCli(['keys', 'create', '--project', 'acme'], env);
  t.match(human.stdout, /svc_live_[A-Za-z0-9]{32,}/, 'live by default');
  t.match(human.stdout, /shown this once/);

  // The key works, signed with its secret.
  const accepted = await clientFor(service.url, key).post({ model: 'm', messages: userMessage() });
  t.equal(accepted.status, 202);

  // Neither the key nor the secret is stored in plain text.
  const { rows } = await service.pool.query('select * from gateway.api_keys');
  const stored = JSON.stringify(rows.map((row) => Object.values(row).map((value) => (Buffer.isBuffer(value) ? value.toString('latin1') : value))));
  t.notOk(stored.includes(key.api_key), 'no plain API key');
  t.notOk(stored.includes(key.signing_secret), 'no plain signing secret');
  t.notOk(stored.includes(key.signing_secret.slice('svc_sig_'.length)), 'not even the secret without its prefix');
  const sha = createHash('sha256').update(key.api_key).digest();
  t.ok(rows.some((row) => row.key_sha256.equals(sha)), 'the SHA-256 is what identifies the key');

  const listed = await runCli(['keys', 'list', '--project', 'acme', '--json'], env);
  const keys = JSON.parse(listed.stdout);
  t.equal(keys.length, 2);
  const listedKey = keys.find((entry: { key: string }) => entry.key.endsWith(key.api_key.slice(-4)));
  t.match(listedKey, { project: 'acme', mode: 'test', status: 'active', revoked_at: null });
  t.notOk(listed.stdout.includes(key.api_key), 'listing never shows a key');
  const table = await runCli(['keys', 'list'], env);
  t.match(table.stdout, /^id\s+project\s+mode\s+key\s+status/m);
  t.equal(listedKey.checksum, true, 'a key made now has a checksum');
  // One stored before keys recorded whether they have a checksum (here, of the form without).
  const old = await storeKnownKey(service.db, service.config.secretEncryptionKeys[0]!, {
    apiKey: `svc_test_${randomBase62(40)}`,
    project: 'acme',
    mode: 'test',
  });
  const withOld = JSON.parse((await runCli(['keys', 'list', '--project', 'acme', '--json'], env)).stdout);
  t.equal(withOld.find((entry: { id: string }) => entry.id === old.id).checksum, null, 'one stored before: null, it may have none');
  t.match((await runCli(['keys', 'list'], env)).stdout, new RegExp(`^${old.id}\\s.*\\sunknown\\s`, 'm'), 'shown as unknown');

  t.equal(listedKey.id, key.id, 'the id --json gave is the key\'s');
  const revoked = await runCli(['keys', 'revoke', key.id], env);
  t.equal(revoked.code, 0, revoked.stderr);
  t.match(revoked.stdout, new RegExp(`Revoked key ${key.id}`));
  // The API process hears of it by NOTIFY, a moment after the revocation's commit.
  let refused: Answer | undefined;
  await waitFor(async () => (refused = await clientFor(service.url, key).post({ model: 'm', messages: userMessage() })).status === 401, 5_000, 10);
  t.equal(refused?.status, 401);
  t.equal(refused?.body.error?.code, 'invalid_api_key');

  const unknown = await runCli(['keys', 'revoke', 'key_doesnotexist000000'], env);
  t.equal(unknown.code, 1);
  t.match(unknown.stderr, /No key with id/);
});

t.test('keys create --deadline gives the key a deadline of its own, which keys list shows; a bad one is a usage error', async (t) => {
  const url = await createTestDatabase(t);
  const env = { DATABASE_URL: url, SECRET_ENCRYPTION_KEY: randomBytes(32).toString('base64') };

  const created = await runCli(['keys', 'create', '--project', 'acme', '--deadline', '15m'], env);
  t.equal(created.code, 0, created.stderr);
  t.match(created.stdout, /Deadline: +15m/);
  const json = await runCli(['keys', 'create', '--project', 'acme', '--deadline', '90000', '--json'], env);
  t.equal(json.code, 0, json.stderr);
  t.same(Object.keys(JSON.parse(json.stdout)), ['id', 'project', 'mode', 'api_key', 'signing_secret'], 'the --json shape is unchanged');
  await runCli(['keys', 'create', '--project', 'acme'], env);

  const listed = JSON.parse((await runCli(['keys', 'list', '--project', 'acme', '--json'], env)).stdout);
  t.same(listed.map((key: { deadline: string | null }) => key.deadline), ['15m', '90s', null], 'null: REQUEST_DEADLINE');
  const stored = await adminRows(url, `select (extract(epoch from request_deadline) * 1000)::float8 as ms from gateway.api_keys order by created_at`);
  t.same(stored.map((row) => row.ms), [900_000, 90_000, null]);
  const table = (await runCli(['keys', 'list'], env)).stdout;
  t.match(table, /^id\s+project\s+mode\s+key\s+status\s+deadline/m);
  t.match(table, /active\s+15m\s/);
  t.match(table, /active\s+REQUEST_DEADLINE\s/);

  const refused = {
    soon: '--deadline must be a duration such as 24h, 15m, 90s or 500ms (or a number of milliseconds).',
    '500ms': '--deadline must be at least 1s.',
    '31d': '--deadline must be at most 30d.',
  };
  for (const [value, message] of Object.entries(refused)) {
    const bad = await runCli(['keys', 'create', '--project', 'acme', '--deadline', value], env);
    t.equal(bad.code, 2, `${value}: a usage error`);
    t.ok(bad.stderr.startsWith(`${message}\n`), `${value}: ${bad.stderr.split('\n')[0]}`);
    t.match(bad.stderr, /Usage: gateway/);
  }
  t.same((await adminRows(url, 'select count(*)::int as keys from gateway.api_keys'))[0], { keys: 3 }, 'a refused key is not created');
});

t.test('keys create --deadline longer than REQUEST_DEADLINE shows the deadline its requests get, and stores the one given', async (t) => {
  const url = await createTestDatabase(t);
  const env = { DATABASE_URL: url, SECRET_ENCRYPTION_KEY: randomBytes(32).toString('base64'), REQUEST_DEADLINE: '1h' };

  const longer = await runCli(['keys', 'create', '--project', 'acme', '--deadline', '2h'], env);
  t.equal(longer.code, 0, longer.stderr);
  t.match(longer.stdout, /Deadline: +1h \(REQUEST_DEADLINE, shorter than the 2h given;/, 'the deadline in force, and why');
  t.notMatch(longer.stdout, /Deadline: +2h/);
  const equal = await runCli(['keys', 'create', '--project', 'acme', '--deadline', '1h'], env);
  t.match(equal.stdout, /Deadline: +1h \(its requests fail/, 'one no longer than REQUEST_DEADLINE is shown as given');

  const stored = await adminRows(url, `select (extract(epoch from request_deadline) * 1000)::float8 as ms from gateway.api_keys order by created_at`);
  t.same(stored.map((row) => row.ms), [7_200_000, 3_600_000], 'the key keeps the deadline given: a longer REQUEST_DEADLINE later lets it take effect');
});

t.test('mistakes get a message and a non-zero exit, not a stack trace (the command line as a process)', async (t) => {
  const url = await createTestDatabase(t);
  const help = await runCliProcess(['--help'], {});
  t.equal(help.code, 0);
  t.match(help.stdout, /^Usage: gateway <command>/);
  t.equal(help.stderr, '');

  const noSecret = await runCliProcess(['keys', 'create', '--project', 'x'], { DATABASE_URL: url });
  t.equal(noSecret.code, 1);
  t.match(noSecret.stderr, /SECRET_ENCRYPTION_KEY is not set/);

  const badProject = await runCliProcess(['keys', 'create', '--project', 'no spaces'], {
    DATABASE_URL: url,
    SECRET_ENCRYPTION_KEY: randomBytes(32).toString('base64'),
  });
  t.equal(badProject.code, 1);
  t.match(badProject.stderr, /project name/);

  const serveWithoutDatabase = await runCliProcess(['serve'], {});
  t.equal(serveWithoutDatabase.code, 1);
  t.match(serveWithoutDatabase.stderr, /DATABASE_URL is not set/);

  const badSetting = await runCliProcess(['migrate'], { DATABASE_URL: url, MAX_ATTEMPTS: 'lots' });
  t.equal(badSetting.code, 1);
  t.match(badSetting.stderr, /MAX_ATTEMPTS must be a whole number/);

  const unknownCommand = await runCliProcess(['frobnicate'], { DATABASE_URL: url });
  t.equal(unknownCommand.code, 2);
  t.match(unknownCommand.stderr, /Unknown command/);
  t.match(unknownCommand.stderr, /Usage: gateway/);
});

t.test('a database, a gateway or a file out of reach, and a port in use: one line saying so, exit 1, no stack trace', async (t) => {
  const stack = /\n\s+at /;
  const client = { GATEWAY_API_KEY: 'svc_test_x', GATEWAY_SIGNING_SECRET: 'svc_sig_x' };

  const closedPort = await freePort();
  const noGateway = await runCli(['request', 'GET', '/v1/requests/req_x'], { ...client, GATEWAY_BASE_URL: `http://127.0.0.1:${closedPort}` });
  t.equal(noGateway.code, 1);
  t.equal(noGateway.stderr, `No answer from http://127.0.0.1:${closedPort}: connection refused (connect ECONNREFUSED 127.0.0.1:${closedPort}).\n`);

  const noFile = await runCli(['request', 'POST', '/v1/chat/completions', '@/nonexistent/body.json'], client);
  t.equal(noFile.code, 1);
  t.equal(noFile.stderr, "Cannot read the body from /nonexistent/body.json: ENOENT: no such file or directory, open '/nonexistent/body.json'\n");

  const url = await createTestDatabase(t);
  const noServer = await runCli(['stats'], { DATABASE_URL: `postgres://postgres@127.0.0.1:${closedPort}/gateway` });
  t.equal(noServer.code, 1);
  t.equal(noServer.stderr, `Cannot connect: connection refused (connect ECONNREFUSED 127.0.0.1:${closedPort}).\n`);
  const noDatabase = await runCli(['keys', 'list'], { DATABASE_URL: `${url}_missing` });
  t.equal(noDatabase.code, 1);
  t.match(noDatabase.stderr, /^The database refused: database "\w+_missing" does not exist \(SQLSTATE 3D000\)\.\n$/);

  // As a process, as `serve` runs: the API's port is held by another socket.
  const holder = net.createServer();
  await new Promise<void>((resolve) => holder.listen(0, '127.0.0.1', resolve));
  t.teardown(() => new Promise<void>((resolve) => holder.close(() => resolve())));
  const port = (holder.address() as net.AddressInfo).port;
  const portInUse = await runCliProcess(['serve', '--role', 'api'], {
    DATABASE_URL: url,
    SECRET_ENCRYPTION_KEY: randomBytes(32).toString('base64'),
    HOST: '127.0.0.1',
    PORT: String(port),
  });
  t.equal(portInUse.code, 1);
  t.match(portInUse.stderr, `listen EADDRINUSE: address already in use 127.0.0.1:${port}: another process listens there`);
  t.notMatch(portInUse.stderr, stack, portInUse.stderr);
});

t.test('request says what it cannot send as such, in one line, never with the key, rather than that the gateway did not answer', async (t) => {
  const closedPort = await freePort();
  const env = { GATEWAY_API_KEY: 'svc_test_x', GATEWAY_SIGNING_SECRET: 'svc_sig_x', GATEWAY_BASE_URL: `http://127.0.0.1:${closedPort}` };
  const cases: [string[], Record<string, string>, string][] = [
    [['GET', '/v1/requests/req_x', '{}'], {}, 'Cannot send GET /v1/requests/req_x: Request with GET/HEAD method cannot have body.\n'],
    [['GE T', '/v1/requests/req_x'], {}, "Cannot send GE T /v1/requests/req_x: 'GE T' is not a valid HTTP method.\n"],
    // A key pasted with a line break in it: a header cannot carry it, and the message named it whole.
    [['GET', '/v1/requests/req_x'], { GATEWAY_API_KEY: 'svc_test_first\nsecond' }, 'Cannot send GET /v1/requests/req_x: Headers.append: "Bearer <GATEWAY_API_KEY>" is an invalid header value.\n'],
  ];
  for (const [args, settings, said] of cases) {
    const result = await runCli(['request', ...args], { ...env, ...settings });
    t.equal(result.code, 1, args.join(' '));
    t.equal(result.stderr, said, args.join(' '));
  }
});

t.test('request refuses a base URL with a user name or password without printing the password', async (t) => {
  const closedPort = await freePort();
  const password = `pw${randomBase62(24)}`;
  const result = await runCli(['request', 'GET', '/v1/requests/req_x'], {
    GATEWAY_API_KEY: 'svc_test_x',
    GATEWAY_SIGNING_SECRET: 'svc_sig_x',
    GATEWAY_BASE_URL: `http://operator:${password}@127.0.0.1:${closedPort}`,
  });
  t.equal(result.code, 1);
  t.equal(
    result.stderr,
    `Cannot call /v1/requests/req_x on http://127.0.0.1:${closedPort}/: ` +
      'The base URL cannot carry a user name or password (fetch refuses such a URL): send credentials in headers.\n',
  );
  t.notOk(`${result.stdout}${result.stderr}`.includes(password), 'the password is not printed');
});

t.test('an embedded Postgres that cannot start (its port held): one line saying why, exit 1, no stack', async (t) => {
  const dataDir = await mkdtemp(path.join(tmpdir(), 'gateway-cli-embedded-'));
  // Run as root, the embedded Postgres runs as a "postgres" user, which must reach its directory.
  await chmod(dataDir, 0o755);
  t.teardown(() => rm(dataDir, { recursive: true, force: true }));
  const holder = net.createServer();
  await new Promise<void>((resolve) => holder.listen(0, '127.0.0.1', resolve));
  t.teardown(() => new Promise<void>((resolve) => holder.close(() => resolve())));
  const port = (holder.address() as net.AddressInfo).port;

  const result = await runCliProcess(['stats'], { DATA_DIR: dataDir, EMBEDDED_POSTGRES_PORT: String(port) });
  t.equal(result.code, 1);
  t.equal(
    result.stderr,
    `The embedded Postgres in ${dataDir}/postgres did not start: could not create any TCP/IP sockets ` +
      `(is port ${port} already in use? set EMBEDDED_POSTGRES_PORT to choose another).\n`,
  );
});

t.test('request makes signed calls from the environment\'s key and secret', async (t) => {
  const service = await startTestGateway(t);
  const key = await service.createKey();
  const env = { GATEWAY_API_KEY: key.api_key, GATEWAY_SIGNING_SECRET: key.signing_secret, GATEWAY_BASE_URL: service.url };

  const body = JSON.stringify({ model: 'test-echo', messages: userMessage('from the command line'), wait: true });
  const created = await runCli(['request', 'POST', '/v1/chat/completions', body, '--verbose'], env);
  t.equal(created.code, 0, created.stderr);
  t.match(created.stderr, /HTTP 200/);
  t.match(created.stderr, /string to sign:\n {4}v1\n {4}\d+\n {4}[A-Za-z0-9_-]+\n {4}POST\n {4}\/v1\/chat\/completions\n {4}[0-9a-f]{64}/);
  t.notOk(created.stderr.includes(key.signing_secret), 'the secret is never printed');
  const completion = JSON.parse(created.stdout);
  t.equal(completion.choices[0].message.content, 'from the command line');

  const { rows } = await service.pool.query('select id from gateway.requests');
  const lookup = await runCli(['request', 'GET', `/v1/requests/${rows[0].id}`], env);
  t.equal(lookup.code, 0);
  t.match(JSON.parse(lookup.stdout), { id: rows[0].id, status: 'completed' });

  const missing = await runCli(['request', 'GET', '/v1/requests/req_00000000000000000000'], env);
  t.equal(missing.code, 1, 'a non-2xx answer exits 1');
  t.match(missing.stderr, /HTTP 404/);
  t.match(JSON.parse(missing.stdout), { error: { code: 'request_not_found' } });

  const noCredentials = await runCli(['request', 'GET', '/v1/requests/x'], { GATEWAY_BASE_URL: service.url });
  t.equal(noCredentials.code, 1);
  t.match(noCredentials.stderr, /GATEWAY_API_KEY and GATEWAY_SIGNING_SECRET/);
});

t.test('request sends and signs the path as the URL encodes it, and ignores a base URL\'s trailing /v1 as the client library does', async (t) => {
  const service = await startTestGateway(t);
  const key = await service.createKey({ mode: 'test' });
  const env = { GATEWAY_API_KEY: key.api_key, GATEWAY_SIGNING_SECRET: key.signing_secret, GATEWAY_BASE_URL: service.url };

  // A space, a non-ASCII letter, a space in the query, a `..` segment and an empty query: each is
  // encoded or resolved on its way, so what is signed must be what the URL became.
  for (const path of ['/v1/requests/req abc', '/v1/requests/req_é', '/v1/requests/req_x?a=b c', '/v1/requests/a/../req_x', '/v1/requests/req_x?']) {
    const result = await runCli(['request', 'GET', path], env);
    t.equal(result.code, 1, path);
    t.match(result.stderr, /HTTP 404/, `${path}: looked up, not refused as badly signed: ${result.stdout}`);
    t.match(JSON.parse(result.stdout), { error: { code: 'request_not_found' } }, path);
  }
  const verbose = await runCli(['request', 'GET', '/v1/requests/req é?a=b c', '--verbose'], env);
  t.match(verbose.stderr, `> GET ${service.url}/v1/requests/req%20%C3%A9?a=b%20c\n`, '--verbose shows the URL sent');
  t.match(verbose.stderr, /\n {4}GET\n {4}\/v1\/requests\/req%20%C3%A9\?a=b%20c\n/, 'and the path signed, as sent');

  const accepted = await runCli(['request', 'POST', '/v1/chat/completions', JSON.stringify({ model: 'test-echo', messages: userMessage() })], env);
  const { id } = JSON.parse(accepted.stdout);
  for (const baseUrl of [`${service.url}/v1`, `${service.url}/v1/`]) {
    const lookup = await runCli(['request', 'GET', `/v1/requests/${id}`, '--verbose'], { ...env, GATEWAY_BASE_URL: baseUrl });
    t.equal(lookup.code, 0, `${baseUrl}: ${lookup.stderr}`);
    t.match(lookup.stderr, `> GET ${service.url}/v1/requests/${id}\n`, `${baseUrl}: not /v1/v1/`);
    t.match(JSON.parse(lookup.stdout), { id });
  }

  const outside = await runCli(['request', 'GET', '//example.com/v1/requests/req_x'], env);
  t.equal(outside.code, 1);
  t.match(outside.stderr, /^Cannot call \/\/example.com\/v1\/requests\/req_x on .*not under the gateway's base URL/);
});
