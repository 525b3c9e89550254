// SQL of the rescue of stranded queues (worker/rescue.ts): queues with requests due that nothing
// is going to dispatch.
import { sql } from 'kysely';
import type { Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';
import { DISPATCH_QUEUE } from '../lanes/jobs.ts';

/** A queue found stranded, and dispatched. */
export interface RescuedQueue {
  id: string;
  mode: KeyMode;
}

/** The job key of a rescue's dispatch: rescues of one queue by several workers at once add one job. */
const RESCUE_KEY_PREFIX = 'dispatch_rescue:';

/**
 * Adds a dispatch_queue job, due now, for up to `limit` queues that have a request due for at
 * least `afterMs` and nothing to dispatch it:
 * - no claim of the queue for `afterMs` (a claim brings its lanes' refilled_at up to date: a
 *   queue claimed that recently is being dispatched);
 * - no call in flight whose end dispatches the queue again: one on a lane with max_concurrent,
 *   or a lane's probe;
 * - no dispatch_queue job of the queue, due at any time, or running (a job spent, its attempts
 *   used up, does not count).
 * Returns them.
 *
 * The jobs are read in graphile-worker's own table: its public view (graphile_worker.jobs) leaves
 * the payload out, and the payload is what names the queue. A job is looked for only for the few
 * queues that pass the other tests.
 */
export async function dispatchStranded(db: Db, afterMs: number, limit: number): Promise<RescuedQueue[]> {
  const { rows } = await sql<RescuedQueue>`
    with due as (
      select queues.id, queues.mode
      from gateway.queues
      where exists (
              select from gateway.requests
              where requests.queue_id = queues.id and requests.status in ('queued', 'retrying')
                and requests.next_attempt_at <= now() - ${afterMs}::float8 * interval '1 millisecond')
        and not exists (
              select from gateway.lanes
              where lanes.queue_id = queues.id and lanes.refilled_at > now() - ${afterMs}::float8 * interval '1 millisecond')
        and not exists (
              select from gateway.lanes
              join gateway.requests on requests.lane_id = lanes.id and requests.status = 'processing'
              where lanes.queue_id = queues.id
                and (lanes.max_concurrent is not null or requests.id = lanes.probe_request_id))
      order by queues.id
      limit ${limit}
    ), stranded as (
      select due.id, due.mode
      from due
      where not exists (
        select from graphile_worker._private_jobs as jobs
        join graphile_worker._private_tasks as tasks on tasks.id = jobs.task_id
        where tasks.identifier = ${DISPATCH_QUEUE} and jobs.payload->>'queue_id' = due.id::text
          and (jobs.locked_at is not null or jobs.attempts < jobs.max_attempts)
      )
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${DISPATCH_QUEUE}, json_build_object('queue_id', stranded.id), null, null, null,
                   ${RESCUE_KEY_PREFIX} || stranded.id, null, null)::graphile_worker.job_spec
        -- In one order, so that rescues by several workers at once cannot deadlock.
        from stranded order by stranded.id
      ))
      where exists (select from stranded)
    )
    select stranded.id::text as id, stranded.mode from stranded cross join queued
  `.execute(db);
  return rows;
}
