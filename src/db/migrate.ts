// Applies the numbered, forward-only migrations in sql/ (each in its own transaction), then
// graphile-worker's own. Several processes may migrate at once: an advisory lock lets one
// work while the others wait, and then find nothing left to do.
//
// A released migration is never edited: a database that ran it would keep the old text and
// nothing would say so. So each applied file's SHA-256 is recorded, and a file that no longer
// matches what a database ran stops `gateway migrate` and every gateway process at start,
// naming the file. (Migrations applied before hashes were recorded get the file's hash as it is
// when first seen.)
import { createHash } from 'node:crypto';
import { readdir, readFile } from 'node:fs/promises';
import { runMigrations } from 'graphile-worker';
import type { Selectable } from 'kysely';
import type pg from 'pg';
import type { Logger } from '../logger.ts';
import type { Database } from './database.ts';
import { graphileLogger } from './graphile-logger.ts';
import { poolQuery, SCHEMA } from './pool.ts';

const SQL_DIR = new URL('../../sql/', import.meta.url);
const MIGRATION_FILE = /^(\d{6})\.sql$/;
// pg_advisory_lock key for "gateway migrate": an arbitrary constant, fixed forever.
const MIGRATION_LOCK = 7_242_318_001;

/** What is read of gateway.migrations to compare with the files. */
type Applied = Pick<Selectable<Database['migrations']>, 'id' | 'sha256'>;

export interface Migration {
  id: number;
  file: string;
  text: string;
  sha256: Buffer;
}

/** Where the migrations are read from: sql/ of this checkout (a test points it at a copy). */
export interface MigrationSource {
  sqlDir?: URL | undefined;
}

/** The migration files of the directory, in order, unread. */
async function migrationFiles(sqlDir: URL): Promise<{ id: number; file: string }[]> {
  return (await readdir(sqlDir))
    .flatMap((file) => {
      const match = MIGRATION_FILE.exec(file);
      return match ? [{ id: Number(match[1]), file }] : [];
    })
    .sort((a, b) => a.id - b.id);
}

export async function listMigrations(source: MigrationSource = {}): Promise<Migration[]> {
  const sqlDir = source.sqlDir ?? SQL_DIR;
  return Promise.all(
    (await migrationFiles(sqlDir)).map(async ({ id, file }) => {
      const text = await readFile(new URL(file, sqlDir), 'utf8');
      return { id, file, text, sha256: createHash('sha256').update(text).digest() };
    }),
  );
}

/** A released migration was edited after a database ran it. */
export class MigrationChangedError extends Error {
  readonly file: string;

  constructor(file: string) {
    super(
      `sql/${file} is not the file this database applied: it was edited after it was released. ` +
        `Restore it as it was (git log -- sql/${file}), and make the change a new migration.`,
    );
    this.name = 'MigrationChangedError';
    this.file = file;
  }
}

/**
 * Other texts of a released file that a database may have applied, by the file's id (their
 * SHA-256, in hex): each did what the file does, wherever it ran, so a database that applied one
 * is current. 000019's first text wrote its `set compression` statements out in its PL/pgSQL
 * block, which Postgres 13 refuses to parse even in the branch it does not take: no migration
 * could run past it there. On the servers that ran it, it did what the file does.
 */
const EQUIVALENT_TEXTS: ReadonlyMap<number, readonly string[]> = new Map([
  [19, ['ad9180a6d8ff5428a5b649d5b2807775d7bdce54b3d5458457ba863a7a28ebea']],
]);

/** The first applied migration whose file differs from what was applied (hashes as recorded). */
function changedMigration(migrations: readonly Migration[], applied: ReadonlyMap<number, Buffer | null>): Migration | undefined {
  return migrations.find((migration) => {
    const recorded = applied.get(migration.id);
    if (recorded == null || recorded.equals(migration.sha256)) return false;
    return !EQUIVALENT_TEXTS.get(migration.id)?.includes(recorded.toString('hex'));
  });
}

export async function migrate(pool: pg.Pool, logger: Logger, source: MigrationSource = {}): Promise<void> {
  const migrations = await listMigrations(source);
  const client = await pool.connect();
  try {
    await client.query('select pg_advisory_lock($1)', [MIGRATION_LOCK]);
    try {
      await client.query(`create schema if not exists ${SCHEMA}`);
      await client.query(
        `create table if not exists ${SCHEMA}.migrations (
           id integer primary key,
           applied_at timestamptz not null default now()
         )`,
      );
      await client.query(`alter table ${SCHEMA}.migrations add column if not exists sha256 bytea`);
      await client.query(
        `comment on table ${SCHEMA}.migrations is 'Which files of sql/ have been applied, and when.'`,
      );
      await client.query(
        `comment on column ${SCHEMA}.migrations.sha256 is 'SHA-256 of the file as applied (or as first seen, for files applied before hashes were recorded).'`,
      );
      const applied = new Map(
        (await client.query<Applied>(`select id, sha256 from ${SCHEMA}.migrations`)).rows.map(
          (row) => [row.id, row.sha256],
        ),
      );
      const changed = changedMigration(migrations, applied);
      if (changed) throw new MigrationChangedError(changed.file);
      for (const migration of migrations) {
        if (applied.get(migration.id) !== null) continue;
        await client.query(`update ${SCHEMA}.migrations set sha256 = $2 where id = $1 and sha256 is null`, [migration.id, migration.sha256]);
      }
      const newest = Math.max(0, ...applied.keys());
      const known = migrations.at(-1)?.id ?? 0;
      if (newest > known) {
        throw new Error(
          `The database schema is at migration ${newest}, newer than this gateway knows (${known}); upgrade the gateway.`,
        );
      }
      for (const migration of migrations) {
        if (applied.has(migration.id)) continue;
        await client.query('begin');
        try {
          await client.query(migration.text);
          await client.query(`insert into ${SCHEMA}.migrations (id, sha256) values ($1, $2)`, [migration.id, migration.sha256]);
          await client.query('commit');
        } catch (error) {
          await client.query('rollback');
          throw new Error(`Migration ${migration.file} failed: ${(error as Error).message}`, { cause: error });
        }
        logger.info({ migration: migration.file }, 'applied migration');
      }
      await runMigrations({ pgPool: pool, logger: graphileLogger(logger) });
      await tuneAddJobsPlans(client);
    } finally {
      await client.query('select pg_advisory_unlock($1)', [MIGRATION_LOCK]);
    }
  } finally {
    client.release();
  }
}

const ADD_JOBS = 'graphile_worker.add_jobs(graphile_worker.job_spec[], boolean)';
const ADD_JOBS_SETTINGS = [
  ['enable_seqscan', 'off'],
  ['plan_cache_mode', 'force_generic_plan'],
] as const;

/**
 * graphile-worker's add_jobs is PL/pgSQL, so each connection caches the plans of its
 * statements. Two settings on the function make those plans cheap whatever the queue holds:
 * - enable_seqscan off. A generic plan made while the jobs table is small (a fresh database,
 *   or workers that keep up) clears the keys of locked jobs by a sequential scan of the whole
 *   table, and keeps doing so however long the queue grows, until autovacuum next analyzes the
 *   table: with a long queue, that scan costs more than the rest of a grouped accept. Each of
 *   the function's statements has an index to use, and with this setting its plans use it.
 * - plan_cache_mode force_generic_plan. For a call with one or a few jobs (a wait=true request
 *   alone in its statement) Postgres judges a fresh plan cheaper, and plans the function's five
 *   statements at every call, which costs more than running them. The generic plans, on
 *   indexes, serve every size.
 * Applied after every graphile-worker migration, which may replace the function (and so drop
 * the settings).
 */
async function tuneAddJobsPlans(client: pg.PoolClient): Promise<void> {
  const { rows } = await client.query<{ config: string[] | null }>(
    `select proconfig as config from pg_proc where oid = '${ADD_JOBS}'::regprocedure`,
  );
  const config = rows[0]?.config ?? [];
  for (const [name, value] of ADD_JOBS_SETTINGS) {
    if (!config.includes(`${name}=${value}`)) await client.query(`alter function ${ADD_JOBS} set ${name} = ${value}`);
  }
}

/**
 * Throws MigrationChangedError when a file of sql/ differs from what the database applied. For a
 * process's start: the same check that `gateway migrate` makes first.
 */
export async function assertMigrationsUnchanged(pool: pg.Pool, source: MigrationSource = {}): Promise<void> {
  const { rows: columns } = await poolQuery(
    pool,
    `select from information_schema.columns where table_schema = '${SCHEMA}' and table_name = 'migrations' and column_name = 'sha256'`,
  );
  if (columns.length === 0) return;
  const { rows } = await poolQuery<Applied>(pool, `select id, sha256 from ${SCHEMA}.migrations`);
  const changed = changedMigration(await listMigrations(source), new Map(rows.map((row) => [row.id, row.sha256])));
  if (changed) throw new MigrationChangedError(changed.file);
}

/** The newest applied migration and the newest this code knows; equal when the schema is current. */
export async function schemaVersion(pool: pg.Pool): Promise<{ applied: number; expected: number }> {
  const expected = (await migrationFiles(SQL_DIR)).at(-1)?.id ?? 0;
  const exists = await poolQuery<{ exists: boolean }>(pool, `select to_regclass('${SCHEMA}.migrations') is not null as exists`);
  if (!exists.rows[0]?.exists) return { applied: 0, expected };
  const { rows } = await poolQuery<{ applied: number | null }>(pool, `select max(id) as applied from ${SCHEMA}.migrations`);
  return { applied: rows[0]?.applied ?? 0, expected };
}
