// A released migration is never edited: each applied file's SHA-256 is recorded, and a file that
// no longer matches what the database ran stops `gateway migrate` and every gateway process at
// start, naming the file.
import { execFile } from 'node:child_process';
import { cp, appendFile, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { promisify } from 'node:util';
import t, { type Test } from 'tap';
import { assertMigrationsUnchanged, listMigrations, migrate } from '../../src/db/migrate.ts';
import { createPool } from '../../src/db/pool.ts';
import { createLogger } from '../../src/logger.ts';
import { runCli } from '../helpers/cli.ts';
import { adminQuery, createTestDatabase, urlForDatabase } from '../helpers/database.ts';
import { childEnv } from '../helpers/node-child.ts';

const silent = createLogger({ logLevel: 'silent' });
const CLI = new URL('../../src/cli.ts', import.meta.url).pathname;

/** An empty database of the test's own (not a clone of the migrated template). */
async function emptyDatabase(t: Test): Promise<string> {
  const adminUrl = process.env.GATEWAY_TEST_ADMIN_URL!;
  const name = `gateway_test_empty_${Math.random().toString(36).slice(2, 10)}`;
  await adminQuery(adminUrl, (client) => client.query(`create database ${name}`).then(() => {}));
  t.teardown(() => adminQuery(adminUrl, (client) => client.query(`drop database if exists ${name} with (force)`).then(() => {})));
  return urlForDatabase(adminUrl, name);
}

/** A copy of sql/ in a directory of the test's own. */
async function copyOfSql(t: Test): Promise<{ dir: string; url: URL }> {
  const dir = await mkdtemp(path.join(tmpdir(), 'gateway-sql-'));
  t.teardown(() => rm(dir, { recursive: true, force: true }));
  await cp(new URL('../../sql/', import.meta.url), dir, { recursive: true });
  return { dir, url: pathToFileURL(`${dir}/`) };
}

t.test('an edited migration stops gateway migrate, naming the file; restored, migrating goes on', async (t) => {
  const pool = createPool(await emptyDatabase(t), { max: 2, applicationName: 'migrations-test', logger: silent });
  t.teardown(() => pool.end());
  const sql = await copyOfSql(t);
  await migrate(pool, silent, { sqlDir: sql.url });

  const { rows } = await pool.query<{ id: number; sha256: Buffer }>('select id, sha256 from gateway.migrations order by id');
  const files = await listMigrations({ sqlDir: sql.url });
  t.same(rows.map((row) => [row.id, row.sha256.toString('hex')]), files.map((file) => [file.id, file.sha256.toString('hex')]), 'each file\'s hash recorded');

  const edited = path.join(sql.dir, '000005.sql');
  const original = await readFile(edited, 'utf8');
  await appendFile(edited, '\n-- a change made after the release\n');
  await t.rejects(migrate(pool, silent, { sqlDir: sql.url }), {
    name: 'MigrationChangedError',
    message: /^sql\/000005\.sql is not the file this database applied: it was edited after it was released\./,
  });
  await t.rejects(assertMigrationsUnchanged(pool, { sqlDir: sql.url }), { name: 'MigrationChangedError', file: '000005.sql' }, 'the start-up check says the same');

  await writeFile(edited, original);
  await migrate(pool, silent, { sqlDir: sql.url });
  await assertMigrationsUnchanged(pool, { sqlDir: sql.url });
  t.pass('restored, migrate and the start-up check pass');
});

t.test('migrations applied before hashes were recorded get theirs when first seen, and are checked from then on', async (t) => {
  const pool = createPool(await emptyDatabase(t), { max: 2, applicationName: 'migrations-test', logger: silent });
  t.teardown(() => pool.end());
  const sql = await copyOfSql(t);
  await migrate(pool, silent, { sqlDir: sql.url });
  // As a database migrated before hashes existed: no column.
  await pool.query('alter table gateway.migrations drop column sha256');
  await assertMigrationsUnchanged(pool, { sqlDir: sql.url });
  await appendFile(path.join(sql.dir, '000003.sql'), '\n-- edited before hashes were recorded\n');
  await migrate(pool, silent, { sqlDir: sql.url });
  const { rows } = await pool.query<{ missing: number }>('select count(*)::int as missing from gateway.migrations where sha256 is null');
  t.equal(rows[0]!.missing, 0, 'every applied migration has its hash');
  await appendFile(path.join(sql.dir, '000003.sql'), '-- and again after\n');
  await t.rejects(migrate(pool, silent, { sqlDir: sql.url }), { name: 'MigrationChangedError', file: '000003.sql' });
});

t.test('gateway migrate and a gateway process refuse a database that applied another version of a file', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  await adminQuery(databaseUrl, (client) => client.query(`update gateway.migrations set sha256 = sha256('another text') where id = 7`).then(() => {}));

  const migrated = await runCli(['migrate'], { DATABASE_URL: databaseUrl });
  t.not(migrated.code, 0, 'gateway migrate fails');
  t.match(migrated.stderr, /sql\/000007\.sql is not the file this database applied/);

  const { DATABASE_URL: _url, ...inherited } = childEnv();
  const served = await promisify(execFile)(process.execPath, [CLI, 'serve', '--role', 'worker'], {
    env: { ...inherited, DATABASE_URL: databaseUrl, LOG_LEVEL: 'warn' },
    timeout: 60_000,
  }).then(
    () => ({ code: 0, output: '' }),
    (error: { code: number | null; signal: string | null; stdout: string; stderr: string }) => ({
      code: error.code ?? error.signal,
      output: error.stdout + error.stderr,
    }),
  );
  t.not(served.code, 'SIGTERM', 'the worker did not start (it was not stopped by the timeout)');
  t.not(served.code, 0);
  t.match(served.output, /sql\/000007\.sql is not the file this database applied/);
});

t.test('an administrative command refuses a database whose schema is not current, saying to run gateway migrate', async (t) => {
  const databaseUrl = await emptyDatabase(t);
  const listed = await runCli(['keys', 'list'], { DATABASE_URL: databaseUrl });
  t.equal(listed.code, 1);
  t.equal(listed.stdout, '');
  t.match(listed.stderr, /^The database schema is at migration 0, this gateway needs \d+: run `gateway migrate` first\.\n$/, 'one line, no stack');

  const migrated = await runCli(['migrate'], { DATABASE_URL: databaseUrl });
  t.equal(migrated.code, 0, 'gateway migrate runs on it');
  const after = await runCli(['keys', 'list'], { DATABASE_URL: databaseUrl });
  t.equal(after.code, 0, 'then the command runs');
});

t.test('000020: a database that ran 000015 in its first form (claim_queue with seven arguments) ends with the same function as a new one', async (t) => {
  const pool = createPool(await emptyDatabase(t), { max: 2, applicationName: 'migrations-test', logger: silent });
  t.teardown(() => pool.end());
  const signatures = async (): Promise<string[]> =>
    (
      await pool.query<{ args: string }>(
        `select pg_get_function_identity_arguments(oid) as args from pg_proc
         where proname = 'claim_queue' and pronamespace = 'gateway'::regnamespace order by 1`,
      )
    ).rows.map((row) => row.args);
  await migrate(pool, silent);
  const fresh = await signatures();
  const nine = fresh.find((args) => args.endsWith('pace double precision, burst_seconds double precision'));
  t.equal(fresh.length, 2, "a new database has two claim_queues: 000020's nine arguments, and 000024's ten");
  t.ok(nine, 'one of them takes nine arguments, ending with the pace and burst');

  // As a database that ran the first form of 000015 and not 000020: the seven-argument
  // function instead of the nine-argument one.
  await pool.query(`drop function gateway.claim_queue(${nine})`);
  await pool.query(`
    create function gateway.claim_queue(
      claim_queue_id bigint, max_requests integer, claim_worker_id text, lane_ids bigint[],
      limits_max_concurrent integer[], limits_requests_per_minute integer[], limits_tokens_per_minute integer[]
    ) returns void language sql as 'select'`);
  await pool.query('delete from gateway.migrations where id = 20');
  await migrate(pool, silent);
  t.same(await signatures(), fresh, 'after 000020 it has the nine-argument one, and not the seven-argument one');
});

t.test('000019: a database that applied its first text (the one Postgres 13 could not run) is current to gateway migrate and to a process at start', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  const pool = createPool(databaseUrl, { max: 2, applicationName: 'migrations-test', logger: silent });
  t.teardown(() => pool.end());
  // The SHA-256 of that text: the one EQUIVALENT_TEXTS names for 000019 (src/db/migrate.ts).
  await pool.query(`update gateway.migrations set sha256 = '\\xad9180a6d8ff5428a5b649d5b2807775d7bdce54b3d5458457ba863a7a28ebea' where id = 19`);

  await assertMigrationsUnchanged(pool);
  await migrate(pool, silent);
  t.pass('the start-up check and gateway migrate accept it');
  const { rows } = await pool.query<{ sha256: Buffer }>('select sha256 from gateway.migrations where id = 19');
  t.equal(rows[0]!.sha256.toString('hex'), 'ad9180a6d8ff5428a5b649d5b2807775d7bdce54b3d5458457ba863a7a28ebea', 'its record still says what it applied');

  await pool.query(`update gateway.migrations set sha256 = sha256('another text') where id = 19`);
  await t.rejects(migrate(pool, silent), { name: 'MigrationChangedError', file: '000019.sql' }, 'any other text of 000019 is refused');
});
