// SQL of the rescues (worker/rescue.ts): queues with requests due that nothing is going to
// dispatch, webhook endpoints with messages due that nothing is going to deliver, and messages
// left pending on disabled endpoints, that nothing is going to abandon.
import { sql, type RawBuilder } from 'kysely';
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
 * Whether a job (graphile_worker._private_jobs as `jobs`) is stalled: it failed, at least
 * `afterMs` ago, and waits out graphile-worker's backoff, not due for `afterMs` more. A job that
 * throws runs again exp(attempts) seconds after its failure (its run_at, so its failure was that
 * long before it): 2.5 minutes after 5 failures, hours after 9. A database that refused
 * statements for minutes (out of connections, statements timing out) leaves the jobs that ran
 * meanwhile so, and the queues and endpoints they were for would wait that long once it is
 * back. A stalled job does
 * not cover its queue or endpoint; the rescue makes it due now instead, its failures still
 * counted. So a job that fails every time is run about once per `afterMs` (and used up after its
 * max_attempts, spent-jobs.ts), not in a loop. A job due later that never failed (a lane paused,
 * its dispatch scheduled; a retry's) is not stalled.
 */
function stalled(afterMs: number): RawBuilder<boolean> {
  return sql<boolean>`(
    jobs.locked_at is null and jobs.attempts > 0 and jobs.attempts < jobs.max_attempts
    and jobs.run_at > now() + ${afterMs}::float8 * interval '1 millisecond'
    and jobs.run_at - exp(least(jobs.attempts, 10)) * interval '1 second' <= now() - ${afterMs}::float8 * interval '1 millisecond'
  )`;
}

/**
 * Makes the stalled jobs `ids` due now (their attempts kept), in id order; those another
 * statement holds (another worker's rescue, a worker fetching them) are passed over.
 */
function revive(ids: RawBuilder<unknown>, afterMs: number): RawBuilder<unknown> {
  return sql`
    update graphile_worker._private_jobs as jobs
    set run_at = now(), updated_at = now()
    from (
      select jobs.id from graphile_worker._private_jobs as jobs
      where jobs.id = any(${ids})
      order by jobs.id
      for update skip locked
    ) as picked
    where jobs.id = picked.id and ${stalled(afterMs)}
    returning jobs.id
  `;
}

/**
 * Adds a dispatch_queue job, due now, for up to `limit` queues that have a request due for at
 * least `afterMs` and nothing to dispatch it:
 * - no claim of the queue for `afterMs` (a claim brings its lanes' refilled_at up to date: a
 *   queue claimed that recently is being dispatched);
 * - no call in flight whose end dispatches the queue again: one on a lane with max_concurrent,
 *   or a lane's probe;
 * - no dispatch_queue job of the queue, due at any time, or running (a job spent, its attempts
 *   used up, does not count, nor does a stalled one).
 * A queue whose job stalled has that job made due now (the one of lowest id, if it has several);
 * the others get one added. Returns them, but those whose stalled job another statement held (it
 * was not made due; the next look takes it). The limit counts stranded queues only: queues due with
 * a job of their own (a lane paused, its dispatch scheduled) would otherwise fill every batch and
 * hide those after them.
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
      select due.id, due.mode,
             (select min(jobs.id)
              from graphile_worker._private_jobs as jobs
              join graphile_worker._private_tasks as tasks on tasks.id = jobs.task_id
              where tasks.identifier = ${DISPATCH_QUEUE} and jobs.payload->>'queue_id' = due.id::text and ${stalled(afterMs)}) as stalled_job
      from due
      where not exists (
        select from graphile_worker._private_jobs as jobs
        join graphile_worker._private_tasks as tasks on tasks.id = jobs.task_id
        where tasks.identifier = ${DISPATCH_QUEUE} and jobs.payload->>'queue_id' = due.id::text
          and (jobs.locked_at is not null or jobs.attempts < jobs.max_attempts)
          and not ${stalled(afterMs)}
      )
      order by due.id
      limit ${limit}
    ), revived as (
      ${revive(sql`array(select stranded.stalled_job from stranded where stranded.stalled_job is not null)`, afterMs)}
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${DISPATCH_QUEUE}, json_build_object('queue_id', stranded.id), null, null, null,
                   ${RESCUE_KEY_PREFIX} || stranded.id, null, null)::graphile_worker.job_spec
        -- In one order, so that rescues by several workers at once cannot deadlock.
        from stranded where stranded.stalled_job is null order by stranded.id
      ))
      where exists (select from stranded where stranded.stalled_job is null)
    )
    -- A queue whose stalled job another statement held (not made due) is not counted: the next look takes it.
    select stranded.id::text as id, stranded.mode from stranded cross join queued
    where stranded.stalled_job is null or stranded.stalled_job in (select revived.id from revived)
  `.execute(db);
  return rows;
}

/**
 * Adds the wake_webhook_endpoint job, due now, of up to `limit` endpoints that have a message
 * pending and due for at least `afterMs` and nothing to deliver it:
 * - the endpoint is neither disabled nor backing off now;
 * - it has no wake_webhook_endpoint job, due at any time, or running (a stalled one does not
 *   count: it is made due now instead);
 * - no deliver_webhook job names it that is due or running (one due later, a retry of another
 *   message, takes none of the waiting ones).
 * Returns the ids of those woken (not those whose stalled wake another statement held: the next
 * look takes them); the limit counts stranded endpoints only, as dispatchStranded's does. A job
 * spent (its attempts used up) does not count; its row, holding the endpoint's wake key, is taken
 * for the new job.
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
      select due.id,
             (select jobs.id from graphile_worker._private_jobs as jobs
              where jobs.key = ${WAKE_KEY_PREFIX}::text || due.id and ${stalled(afterMs)}) as stalled_job
      from due
      where not exists (
              select from graphile_worker._private_jobs as jobs
              where jobs.key = ${WAKE_KEY_PREFIX}::text || due.id
                and (jobs.locked_at is not null or jobs.attempts < jobs.max_attempts)
                and not ${stalled(afterMs)})
        and not exists (
              select from graphile_worker._private_jobs as jobs
              join graphile_worker._private_tasks as tasks on tasks.id = jobs.task_id
              where tasks.identifier = ${DELIVER_WEBHOOK} and jobs.payload->>'endpoint_id' = due.id
                and (jobs.locked_at is not null or (jobs.attempts < jobs.max_attempts and jobs.run_at <= now())))
      order by due.id
      limit ${limit}
    ), revived as (
      ${revive(sql`array(select stranded.stalled_job from stranded where stranded.stalled_job is not null)`, afterMs)}
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${WAKE_WEBHOOK_ENDPOINT}, json_build_object('endpoint_id', stranded.id, 'deferrals', 0), null, null, null,
                   ${WAKE_KEY_PREFIX}::text || stranded.id, null, null)::graphile_worker.job_spec
        from stranded where stranded.stalled_job is null order by stranded.id
      ))
      where exists (select from stranded where stranded.stalled_job is null)
    )
    select stranded.id from stranded cross join queued
    where stranded.stalled_job is null or stranded.stalled_job in (select revived.id from revived)
  `.execute(db);
  return rows.map((row) => row.id);
}

/** Messages abandoned by one statement of abandonOnDisabledEndpoints: their endpoints, and how many each. */
export interface AbandonedMessages {
  endpoint_id: string;
  messages: number;
}

/**
 * Abandons up to `limit` messages still pending on endpoints disabled at least `afterMs` ago, as
 * the 410 that disabled their endpoint abandons those it sees: a message its statement did not
 * see (written, or made pending again, after the statement began) and whose claim took the
 * endpoint for one that backs off, before the 410 was committed, is left pending with no job
 * (the claim found it paused, and its endpoint's wake is not added for a disabled endpoint);
 * nothing else would end it. Messages locked by a claim at the same moment are passed over (the
 * claim abandons them, or the next look). Returns, per endpoint, how many.
 */
export async function abandonOnDisabledEndpoints(db: Db, afterMs: number, limit: number): Promise<AbandonedMessages[]> {
  const { rows } = await sql<{ endpoint_id: string; messages: string }>`
    with stranded as (
      select messages.id
      from gateway.webhook_endpoints as endpoints
      join gateway.webhook_messages as messages on messages.endpoint_id = endpoints.id and messages.status = 'pending'
      where endpoints.disabled_at <= now() - ${afterMs}::float8 * interval '1 millisecond'
      order by messages.id
      limit ${limit}
      for update of messages skip locked
    ), abandoned as (
      update gateway.webhook_messages as messages
      set status = 'abandoned', next_try_at = null, finished_at = now()
      from stranded
      where messages.id = stranded.id
      returning messages.endpoint_id
    )
    select abandoned.endpoint_id, count(*) as messages from abandoned group by abandoned.endpoint_id order by abandoned.endpoint_id
  `.execute(db);
  return rows.map((row) => ({ endpoint_id: row.endpoint_id, messages: Number(row.messages) }));
}
