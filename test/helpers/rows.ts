// Reading requests and attempts straight from the database, and waiting for a state.
import { sql } from 'kysely';
import type { Db } from '../../src/db/pool.ts';

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

/** The dispatch_lane jobs in the queue (the public jobs view does not show payloads), oldest first. */
export async function dispatchJobs(db: Db): Promise<{ lane_id: string; run_at: Date }[]> {
  const { rows } = await sql<{ lane_id: string; run_at: Date }>`
    select jobs.payload->>'lane_id' as lane_id, jobs.run_at
    from graphile_worker._private_jobs as jobs
    join graphile_worker._private_tasks as tasks on tasks.id = jobs.task_id
    where tasks.identifier = 'dispatch_lane'
    order by jobs.id
  `.execute(db);
  return rows;
}

/** The lane a request waits in (as an int8 string). */
export async function laneOf(db: Db, id: string): Promise<string> {
  const row = await db.selectFrom('requests').select('lane_id').where('id', '=', id).executeTakeFirstOrThrow();
  return row.lane_id!;
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
