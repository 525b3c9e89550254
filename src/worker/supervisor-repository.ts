// SQL of the worker supervisor (worker/supervisor.ts): the heartbeats of gateway.worker_pools,
// and the sweep that presumes dead the workers not heard from and releases their jobs.
import { hostname } from 'node:os';
import { sql } from 'kysely';
import type { Db } from '../db/pool.ts';

/** Writes the heartbeat of these workers (pools and dispatchers): their rows, created on the first beat. */
export async function beat(db: Db, ids: readonly string[]): Promise<void> {
  await sql`
    insert into gateway.worker_pools (id, hostname, pid)
    select id, ${hostname()}, ${process.pid} from unnest(${ids}::text[]) as ids(id)
    on conflict (id) do update set last_seen_at = now()
  `.execute(db);
}

/** What a sweep found. */
export interface Swept {
  /** The workers presumed dead, whose jobs it released. */
  released: string[];
  /**
   * In how many milliseconds the oldest heartbeat of another worker it left grows older than
   * deadAfterMs (null when there is none): when a sweep would next find a worker dead.
   */
  nextDeathInMs: number | null;
}

/**
 * Releases the jobs of workers presumed dead: those whose heartbeat is older than deadAfterMs,
 * and any pool holding jobs for that long without ever having had a heartbeat row; never
 * `live`, the caller's own. (Their attempts are found next, by findLostAttempts.)
 */
export async function sweep(db: Db, deadAfterMs: number, live: readonly string[] = []): Promise<Swept> {
  const { rows } = await sql<{ ids: string[]; next_death_in_ms: number | null }>`
    with dead as (
      delete from gateway.worker_pools
      where last_seen_at < now() - ${deadAfterMs}::float8 * interval '1 millisecond' and id <> all(${live}::text[])
      returning id
    ), orphans as (
      select distinct locked_by as id from graphile_worker.jobs
      where locked_by is not null
        and locked_at < now() - ${deadAfterMs}::float8 * interval '1 millisecond'
        and locked_by not in (select id from gateway.worker_pools)
        and locked_by <> all(${live}::text[])
    ), released as (
      select array(select id from dead union select id from orphans) as ids
    ), left_alive as (
      -- (the statement sees the rows as they were before its delete: those not deleted are these)
      select min(last_seen_at) as oldest from gateway.worker_pools
      where last_seen_at >= now() - ${deadAfterMs}::float8 * interval '1 millisecond' and id <> all(${live}::text[])
    )
    select ids, graphile_worker.force_unlock_workers(ids),
           extract(epoch from oldest + ${deadAfterMs}::float8 * interval '1 millisecond' - now())::float8 * 1000 as next_death_in_ms
    from released, left_alive
  `.execute(db);
  const row = rows[0];
  return { released: row?.ids ?? [], nextDeathInMs: row?.next_death_in_ms ?? null };
}

/** Releases the jobs of these workers and deletes their rows: they are stopping or stopped. */
export async function release(db: Db, poolIds: string[]): Promise<void> {
  await sql`select graphile_worker.force_unlock_workers(${poolIds}::text[])`.execute(db);
  await db.deleteFrom('worker_pools').where('id', 'in', poolIds).execute();
}

