// Applies the numbered, forward-only migrations in sql/ (each in its own transaction), then
// graphile-worker's own. Several processes may migrate at once: an advisory lock lets one
// work while the others wait, and then find nothing left to do.
import { readdir, readFile } from 'node:fs/promises';
import { runMigrations } from 'graphile-worker';
import type pg from 'pg';
import type { Logger } from '../logger.ts';
import { graphileLogger } from './graphile-logger.ts';
import { SCHEMA } from './pool.ts';

const SQL_DIR = new URL('../../sql/', import.meta.url);
const MIGRATION_FILE = /^(\d{6})\.sql$/;
// pg_advisory_lock key for "gateway migrate": an arbitrary constant, fixed forever.
const MIGRATION_LOCK = 7_242_318_001;

export interface Migration {
  id: number;
  file: string;
}

export async function listMigrations(): Promise<Migration[]> {
  const files = await readdir(SQL_DIR);
  return files
    .flatMap((file) => {
      const match = MIGRATION_FILE.exec(file);
      return match ? [{ id: Number(match[1]), file }] : [];
    })
    .sort((a, b) => a.id - b.id);
}

export async function migrate(pool: pg.Pool, logger: Logger): Promise<void> {
  const migrations = await listMigrations();
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
      await client.query(
        `comment on table ${SCHEMA}.migrations is 'Which files of sql/ have been applied, and when.'`,
      );
      const applied = new Set(
        (await client.query<{ id: number }>(`select id from ${SCHEMA}.migrations`)).rows.map((row) => row.id),
      );
      const newest = Math.max(0, ...applied);
      const known = migrations.at(-1)?.id ?? 0;
      if (newest > known) {
        throw new Error(
          `The database schema is at migration ${newest}, newer than this gateway knows (${known}); upgrade the gateway.`,
        );
      }
      for (const migration of migrations) {
        if (applied.has(migration.id)) continue;
        const text = await readFile(new URL(migration.file, SQL_DIR), 'utf8');
        await client.query('begin');
        try {
          await client.query(text);
          await client.query(`insert into ${SCHEMA}.migrations (id) values ($1)`, [migration.id]);
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

/** The newest applied migration and the newest this code knows; equal when the schema is current. */
export async function schemaVersion(pool: pg.Pool): Promise<{ applied: number; expected: number }> {
  const expected = (await listMigrations()).at(-1)?.id ?? 0;
  const exists = await pool.query(`select to_regclass('${SCHEMA}.migrations') is not null as exists`);
  if (!exists.rows[0]?.exists) return { applied: 0, expected };
  const { rows } = await pool.query<{ applied: number | null }>(`select max(id) as applied from ${SCHEMA}.migrations`);
  return { applied: rows[0]?.applied ?? 0, expected };
}
