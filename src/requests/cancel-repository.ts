// SQL of cancelling a request (requests/service.ts): one statement ends the request and its
// running attempt.
import { sql } from 'kysely';
import type { RequestStatus } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';

/**
 * Cancels the caller's request (its project and mode) if it has not ended: a queued or retrying
 * one is never started again, a processing one has its running attempt recorded as cancelled
 * (the worker holding its call hears of the request's end and aborts it). The row is locked
 * first, so that an outcome being recorded at the same moment either lands before (and the
 * request ends completed or failed) or finds it cancelled, never both. Returns the status it
 * had, or undefined when there is no such request of the caller's.
 */
export async function cancelRequest(
  db: Db,
  scope: { project_id: string; mode: KeyMode },
  id: string,
): Promise<RequestStatus | undefined> {
  const { rows } = await sql<{ previous_status: RequestStatus }>`
    with target as (
      select requests.id, requests.status as previous_status
      from gateway.requests
      where requests.id = ${id} and requests.project_id = ${scope.project_id} and requests.mode = ${scope.mode}
      for update
    ), cancelled as (
      update gateway.requests
      set status = 'cancelled', finished_at = now(), next_attempt_at = null, updated_at = now()
      from target
      where requests.id = target.id and target.previous_status in ('queued', 'retrying', 'processing')
      returning requests.id, requests.attempts
    ), cut as (
      update gateway.request_attempts
      set outcome = 'cancelled', finished_at = now(),
          duration_ms = round(extract(epoch from now() - request_attempts.started_at) * 1000)::int,
          error_detail = 'the request was cancelled while its call was under way'
      from cancelled
      where request_attempts.request_id = cancelled.id and request_attempts.attempt_number = cancelled.attempts
        and request_attempts.outcome = 'running'
    )
    select target.previous_status from target
  `.execute(db);
  return rows[0]?.previous_status;
}
