// SQL of the rescues (worker/rescue.ts): queues with requests due that nothing is going to
// dispatch, and webhook endpoints with messages due that nothing is going to deliver.
import { sql } from 'kysely';
import type { Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';
import { DISPATCH_QUEUE } from '../lanes/jobs.ts';
import { DELIVER_WEBHOOK, WAKE_KEY_PREFIX, WAKE_WEBHOOK_ENDPOINT } from '../webhooks/jobs.ts';

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
 * Returns them. The limit counts stranded queues only: queues due with a job of their own (a
 * lane paused, its dispatch scheduled) would otherwise fill every batch and hide those after them.
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
    ), stranded as (
      select due.id, due.mode
      from due
      where not exists (
        select from graphile_worker._private_jobs as jobs
        join graphile_worker._private_tasks as tasks on tasks.id = jobs.task_id
        where tasks.identifier = ${DISPATCH_QUEUE} and jobs.payload->>'queue_id' = due.id::text
          and (jobs.locked_at is not null or jobs.attempts < jobs.max_attempts)
      )
      order by due.id
      limit ${limit}
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

/**
 * Adds the wake_webhook_endpoint job, due now, of up to `limit` endpoints that have a message
 * pending and due for at least `afterMs` and nothing to deliver it:
 * - the endpoint is neither disabled nor backing off now;
 * - it has no wake_webhook_endpoint job, due at any time, or running;
 * - no deliver_webhook job names it that is due or running (one due later, a retry of another
 *   message, takes none of the waiting ones).
 * Returns their ids; the limit counts those only, as dispatchStranded's does. A job spent (its
 * attempts used up) does not count; its row, holding the endpoint's wake key, is taken for the
 * new job.
 */
export async function wakeStrandedEndpoints(db: Db, afterMs: number, limit: number): Promise<string[]> {
  const { rows } = await sql<{ id: string }>`
    with due as (
      select endpoints.id
      from gateway.webhook_endpoints as endpoints
      where endpoints.disabled_at is null
        and (endpoints.paused_until is null or endpoints.paused_until <= now())
        and exists (
              select from gateway.webhook_messages as messages
              where messages.endpoint_id = endpoints.id and messages.status = 'pending'
                and messages.next_try_at <= now() - ${afterMs}::float8 * interval '1 millisecond')
    ), stranded as (
      select due.id
      from due
      where not exists (
              select from graphile_worker.jobs
              where jobs.key = ${WAKE_KEY_PREFIX}::text || due.id
                and (jobs.locked_at is not null or jobs.attempts < jobs.max_attempts))
        and not exists (
              select from graphile_worker._private_jobs as jobs
              join graphile_worker._private_tasks as tasks on tasks.id = jobs.task_id
              where tasks.identifier = ${DELIVER_WEBHOOK} and jobs.payload->>'endpoint_id' = due.id
                and (jobs.locked_at is not null or (jobs.attempts < jobs.max_attempts and jobs.run_at <= now())))
      order by due.id
      limit ${limit}
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${WAKE_WEBHOOK_ENDPOINT}, json_build_object('endpoint_id', stranded.id, 'deferrals', 0), null, null, null,
                   ${WAKE_KEY_PREFIX}::text || stranded.id, null, null)::graphile_worker.job_spec
        from stranded order by stranded.id
      ))
      where exists (select from stranded)
    )
    select stranded.id from stranded cross join queued
  `.execute(db);
  return rows.map((row) => row.id);
}
