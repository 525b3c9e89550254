// SQL of the deadline expiry (worker/deadlines.ts): requests not finished by their deadline fail
// with deadline_exceeded.
import { sql } from 'kysely';
import type { Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';
import { DEADLINE_EXCEEDED } from '../upstream/outcome.ts';

/** How many requests of a mode an expiry failed, from one status. */
export interface Expired {
  mode: KeyMode;
  from: 'queued' | 'processing' | 'retrying';
  count: number;
}

/**
 * Fails up to `limit` unfinished requests whose deadline has passed, oldest deadline first, in
 * one statement: each becomes failed with last_error_code deadline_exceeded, and its running
 * attempt, if it has one, is recorded as failed with that code (and the queue of a lane whose
 * probe it was is dispatched, for the next probe). Rows locked by another statement (another
 * worker's expiry, an outcome being recorded) are skipped: the next run looks again. The
 * request's end does the rest through the triggers of gateway.requests: NOTIFY
 * gateway_requests_finished wakes its waiters and makes the worker holding its call abort it,
 * and its request.failed webhook messages are written in this transaction.
 */
export async function expireRequests(db: Db, limit: number): Promise<Expired[]> {
  const { rows } = await sql<{ mode: KeyMode; previous_status: Expired['from']; count: string }>`
    with due as (
      select requests.id, requests.status, clock_timestamp() as ended_at
      from gateway.requests
      where requests.finished_at is null and requests.deadline_at <= now()
      order by requests.deadline_at
      limit ${limit}
      for update skip locked
    ), expired as (
      update gateway.requests
      set status = 'failed', last_error_code = ${DEADLINE_EXCEEDED}, finished_at = due.ended_at, next_attempt_at = null,
          updated_at = due.ended_at
      from due
      where requests.id = due.id
      returning requests.id, requests.mode, requests.attempts, requests.finished_at, due.status as previous_status
    ), cut as (
      -- An insert that finds the attempt's row, as a cancel's does (requests/cancel-repository.ts):
      -- a claim that committed after this statement began, but before its lock on the request,
      -- wrote an attempt row an update would not see. For that claim too, the request's end is
      -- timed as its row is read for its lock (read again if it changed meanwhile), not when the
      -- statement began (as a cancel's is).
      insert into gateway.request_attempts as attempts
        (request_id, attempt_number, outcome, error_code, error_detail, finished_at, duration_ms)
      select expired.id, expired.attempts, 'failed', ${DEADLINE_EXCEEDED}, 'the request''s deadline passed during the call', expired.finished_at, 0
      from expired
      where expired.previous_status = 'processing'
      on conflict (request_id, attempt_number) do update
      set outcome = 'failed', error_code = excluded.error_code, error_detail = excluded.error_detail, finished_at = excluded.finished_at,
          duration_ms = round(extract(epoch from excluded.finished_at - attempts.started_at) * 1000)::int
      where attempts.outcome = 'running'
    ), probe as (
      -- A request that was its lane's probe: the queue is dispatched, for the next probe.
      select gateway.dispatch_probe_queues(array(select id from expired where previous_status = 'processing')) as jobs
    )
    select mode, previous_status, count(*) as count from expired cross join probe group by mode, previous_status
  `.execute(db);
  return rows.map((row) => ({ mode: row.mode, from: row.previous_status, count: Number(row.count) }));
}
