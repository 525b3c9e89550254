// SQL of cancelling a request (requests/service.ts): one statement ends the request and its
// running attempt, and answers the request's record.
import { sql } from 'kysely';
import type { RequestStatus } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';
import type { RecordRow } from './record.ts';

/** What a cancel found: a request that had ended completed or failed, or one cancelled now or before, with its record. */
export type CancelOutcome =
  | { previousStatus: 'completed' | 'failed' }
  | { previousStatus: 'queued' | 'processing' | 'retrying' | 'cancelled'; record: RecordRow };

/**
 * Cancels the caller's request (its project and mode) if it has not ended: a queued or retrying
 * one is never started again, a processing one has its running attempt recorded as cancelled
 * (the worker holding its call hears of the request's end and aborts it; if the call was its
 * lane's probe, the queue is dispatched for the next). The row is locked first, so that an
 * outcome being recorded at the same moment either lands before (and the request ends completed
 * or failed) or finds it cancelled, never both. Returns the status it had, with the record of a
 * request cancelled now or before; undefined when there is no such request of the caller's.
 *
 * The running attempt is written as an insert that finds its row (ON CONFLICT), not as an
 * update. A statement's updates see only the rows committed before it began, and a claim that
 * started the request while the cancel waited for its lock committed the attempt's row after
 * that: an update would miss it, leaving the cancelled request's attempt running, for its worker
 * to record as succeeded. An insert's conflict finds the row however late it was committed. (A
 * processing request always has its attempt's row: the insert never adds one.) The end is timed
 * as the row is read for its lock (clock_timestamp()), not when the statement began (now()): that
 * claim's attempt may have started in between, and would otherwise seem to have started after its
 * request ended, and to have run for a negative time. A row that changed while the lock was
 * awaited is read again once it is locked (its new status, its new time).
 */
export async function cancelRequest(
  db: Db,
  scope: { project_id: string; mode: KeyMode },
  id: string,
): Promise<CancelOutcome | undefined> {
  // The update changes only status, updated_at and finished_at of the row locked by target: the
  // record's other columns are target's. A cancelled request has no result
  // (requests_result_when_completed), so the result is not read.
  const { rows } = await sql<Omit<RecordRow, 'result'> & { previous_status: RequestStatus }>`
    with target as (
      select requests.id, requests.status as previous_status, requests.attempts, requests.created_at,
             requests.updated_at, requests.last_error_code, clock_timestamp() as ended_at
      from gateway.requests
      where requests.id = ${id} and requests.project_id = ${scope.project_id} and requests.mode = ${scope.mode}
      for update
    ), cancelled as (
      update gateway.requests
      set status = 'cancelled', finished_at = target.ended_at, next_attempt_at = null, updated_at = target.ended_at
      from target
      where requests.id = target.id and target.previous_status in ('queued', 'retrying', 'processing')
      returning requests.id, requests.status, requests.attempts, requests.finished_at, requests.updated_at, target.previous_status
    ), cut as (
      insert into gateway.request_attempts as attempts (request_id, attempt_number, outcome, finished_at, duration_ms, error_detail)
      select cancelled.id, cancelled.attempts, 'cancelled', cancelled.finished_at, 0, 'the request was cancelled while its call was under way'
      from cancelled
      where cancelled.previous_status = 'processing'
      on conflict (request_id, attempt_number) do update
      set outcome = 'cancelled', finished_at = excluded.finished_at,
          duration_ms = round(extract(epoch from excluded.finished_at - attempts.started_at) * 1000)::int,
          error_detail = excluded.error_detail
      where attempts.outcome = 'running'
    ), probe as (
      -- A request that was its lane's probe: the queue is dispatched, for the next probe.
      select gateway.dispatch_probe_queues(array(select id from cancelled where previous_status = 'processing')) as jobs
    )
    select target.previous_status, target.id, coalesce(cancelled.status, target.previous_status) as status,
           target.attempts, target.created_at, coalesce(cancelled.updated_at, target.updated_at) as updated_at,
           target.last_error_code
    from target
    cross join probe
    left join cancelled on cancelled.id = target.id
  `.execute(db);
  const row = rows[0];
  if (row === undefined) return undefined;
  const { previous_status: previousStatus, ...record } = row;
  if (previousStatus === 'completed' || previousStatus === 'failed') return { previousStatus };
  return { previousStatus, record: { ...record, result: null } };
}
