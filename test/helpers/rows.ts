// Reading requests and attempts straight from the database, and waiting for a state.
import { sql } from 'kysely';
import type pg from 'pg';
import type { Db } from '../../src/db/pool.ts';
import { claimQueue, ensureLanes, findQueue, type QueueClaim } from '../../src/lanes/repository.ts';
import { DEFAULT_UPSTREAM, NO_LIMITS, SIMULATOR } from '../../src/upstream/upstreams.ts';

export async function requestRow(db: Db, id: string) {
  return db.selectFrom('requests').selectAll().where('id', '=', id).executeTakeFirst();
}

export async function attemptRows(db: Db, id: string) {
  return db
    .selectFrom('request_attempts')
    .selectAll()
    .where('request_id', '=', id)
    .orderBy('attempt_number')
    .execute();
}

export async function countRows(db: Db, table: 'requests' | 'request_attempts' | 'api_keys'): Promise<number> {
  const row = await db.selectFrom(table).select(sql<string>`count(*)`.as('count')).executeTakeFirstOrThrow();
  return Number(row.count);
}

/** The dispatch_queue jobs (the public jobs view does not show payloads), oldest first. */
export async function dispatchJobs(db: Db): Promise<{ queue_id: string; run_at: Date }[]> {
  const { rows } = await sql<{ queue_id: string; run_at: Date }>`
    select jobs.payload->>'queue_id' as queue_id, jobs.run_at
    from graphile_worker._private_jobs as jobs
    join graphile_worker._private_tasks as tasks on tasks.id = jobs.task_id
    where tasks.identifier = 'dispatch_queue'
    order by jobs.id
  `.execute(db);
  return rows;
}

/** The queue a request waits in (as an int8 string). */
export async function queueOf(db: Db, id: string): Promise<string> {
  const row = await db.selectFrom('requests').select('queue_id').where('id', '=', id).executeTakeFirstOrThrow();
  return row.queue_id!;
}

/**
 * Claims up to `max` requests of the request's queue as worker `workerId`, on the one lane a
 * gateway without UPSTREAMS_FILE gives it (the default upstream, or the simulator), without limits.
 */
export async function claimQueueOf(db: Db, id: string, max: number, workerId: string): Promise<QueueClaim> {
  const queue = (await findQueue(db, await queueOf(db, id)))!;
  const [laneId] = await ensureLanes(db, queue, [queue.mode === 'test' ? SIMULATOR : DEFAULT_UPSTREAM]);
  return claimQueue(db, queue.id, max, workerId, [{ laneId: laneId!, limits: NO_LIMITS }]);
}

/** Polls the row until `done` holds; fails with the last row seen after `timeoutMs`. */
export async function waitForRow(
  db: Db,
  id: string,
  done: (row: NonNullable<Awaited<ReturnType<typeof requestRow>>>) => boolean,
  timeoutMs = 10_000,
) {
  const deadline = Date.now() + timeoutMs;
  let row = await requestRow(db, id);
  while (!(row && done(row))) {
    if (Date.now() > deadline) {
      throw new Error(`request ${id} did not reach the expected state; last seen: ${JSON.stringify(row && { status: row.status, attempts: row.attempts, last_error_code: row.last_error_code })}`);
    }
    await new Promise((resolve) => setTimeout(resolve, 20));
    row = await requestRow(db, id);
  }
  return row;
}

export const isTerminal = (row: { status: string }) => row.status === 'completed' || row.status === 'failed' || row.status === 'cancelled';

/** How many of the API's connections to the test's database wait on a lock now (pg_stat_activity). */
export async function apiWaitingOnLock(pool: pg.Pool): Promise<number> {
  return waitingOnLock(pool, 'gateway-api');
}

/**
 * How many connections of one role (its application_name: gateway-api, gateway-worker) to the
 * test's database wait on a lock now (pg_stat_activity).
 */
export async function waitingOnLock(pool: pg.Pool, application: string): Promise<number> {
  const { rows } = await pool.query<{ count: string }>(
    `select count(*) from pg_stat_activity
     where datname = current_database() and application_name = $1 and wait_event_type = 'Lock'`,
    [application],
  );
  return Number(rows[0]!.count);
}
