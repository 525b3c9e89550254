// SQL of the deletion of spent jobs (worker/spent-jobs.ts): graphile-worker jobs that used up
// their attempts, which graphile-worker keeps in its table for good.
import { sql } from 'kysely';
import type { Db } from '../db/pool.ts';

/** A spent job, as it was deleted. */
export interface SpentJob {
  id: string;
  task: string;
  attempts: number;
  /** The error of its last run (graphile-worker keeps its message only). */
  lastError: string | null;
}

/**
 * Deletes up to `limit` jobs that used up their attempts (attempts = max_attempts) and are not
 * running; returns them. graphile-worker never runs such a job again, nor deletes it. (Besides a
 * job failed max_attempts times, one failure is enough for a job that add_jobs replaced, under
 * its key, while it ran: add_jobs marks the running job spent and adds the new one.) Rows locked
 * by another statement (another worker's deletion, an add_jobs taking a spent job's key) are
 * skipped: the next run looks again.
 */
export async function deleteSpentJobs(db: Db, limit: number): Promise<SpentJob[]> {
  const { rows } = await sql<{ id: string; task: string; attempts: number; last_error: string | null }>`
    with spent as (
      select jobs.id
      from graphile_worker._private_jobs as jobs
      where jobs.attempts >= jobs.max_attempts and jobs.locked_at is null
      order by jobs.id
      limit ${limit}
      for update skip locked
    ), deleted as (
      delete from graphile_worker._private_jobs as jobs
      using spent
      where jobs.id = spent.id and jobs.attempts >= jobs.max_attempts and jobs.locked_at is null
      returning jobs.id, jobs.task_id, jobs.attempts, jobs.last_error
    )
    select deleted.id::text as id, tasks.identifier as task, deleted.attempts, deleted.last_error
    from deleted
    join graphile_worker._private_tasks as tasks on tasks.id = deleted.task_id
    order by deleted.id
  `.execute(db);
  return rows.map((row) => ({ id: row.id, task: row.task, attempts: row.attempts, lastError: row.last_error }));
}
