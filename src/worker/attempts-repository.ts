// SQL of the worker's side of requests: recording how attempts ended (they are started by
// gateway.claim_lane, see lanes/repository.ts), finding those whose worker died (the
// supervisor's sweep), and what the dispatcher and the runner ask of a request: has it ended,
// and in which lane does it wait.
import { sql, type Selectable } from 'kysely';
import type { RequestAttemptsTable, RequestsTable } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import { DISPATCH_LANE } from '../lanes/jobs.ts';
import type { Usage } from '../upstream/outcome.ts';

export interface AttemptReport {
  upstreamStatus: number | null;
  durationMs: number | null;
}

export interface AttemptFailure extends AttemptReport {
  code: string;
  detail: string;
}

/** How an attempt ended, and so what becomes of its request. */
export type Finish =
  | ({ kind: 'completed'; id: string; attempt: number; result: string; usage: Usage } & AttemptReport)
  | ({ kind: 'failed'; id: string; attempt: number; pauseMs?: number | undefined } & AttemptFailure)
  | ({ kind: 'retrying'; id: string; attempt: number; delayMs: number; pauseMs?: number | undefined } & AttemptFailure);

/**
 * Records how attempts ended, a group at a time, in one statement: each attempt row, and its
 * request: completed (with its usage), failed, or retrying, with a dispatch of its lane due when
 * the retry is. Each is guarded twice: the attempt must still be running, and the request still
 * processing this very attempt; so a worker presumed dead that comes back late changes nothing.
 * The lanes learn what the attempts taught: an upstream 429 pauses its lane (pauseMs), and a
 * completion corrects the lane's token allowance from the estimate to the usage.
 * Returns, per finish, whether it was applied.
 */
export async function finishAttempts(db: Db, finishes: readonly Finish[]): Promise<boolean[]> {
  const column = <T>(pick: (finish: Finish) => T) => finishes.map(pick);
  const failure = (finish: Finish) => (finish.kind === 'completed' ? undefined : finish);
  const usage = (finish: Finish) => (finish.kind === 'completed' ? finish.usage : undefined);
  const { rows } = await sql<{ ord: string; applied: boolean }>`
    with input as (
      select * from unnest(
        ${column((f) => f.id)}::text[],
        ${column((f) => f.attempt)}::int[],
        ${column((f) => f.kind)}::text[],
        ${column((f) => (f.kind === 'completed' ? f.result : null))}::text[],
        ${column((f) => usage(f)?.prompt ?? null)}::int[],
        ${column((f) => usage(f)?.completion ?? null)}::int[],
        ${column((f) => usage(f)?.total ?? null)}::int[],
        ${column((f) => failure(f)?.code ?? null)}::text[],
        ${column((f) => failure(f)?.detail ?? null)}::text[],
        ${column((f) => f.upstreamStatus)}::int[],
        ${column((f) => f.durationMs)}::int[],
        ${column((f) => (f.kind === 'retrying' ? f.delayMs : null))}::float8[],
        ${column((f) => failure(f)?.pauseMs ?? null)}::float8[]
      ) with ordinality as t(id, attempt, kind, result, prompt_tokens, completion_tokens, total_tokens, code, detail,
                              upstream_status, duration_ms, delay_ms, pause_ms, ord)
    ), attempt_rows as (
      update gateway.request_attempts
      set outcome = case when input.kind = 'completed' then 'succeeded' else 'failed' end,
          finished_at = now(), upstream_status = input.upstream_status, duration_ms = input.duration_ms,
          error_code = input.code, error_detail = input.detail
      from input
      where request_attempts.request_id = input.id and request_attempts.attempt_number = input.attempt
        and request_attempts.outcome = 'running'
    ), finished as (
      update gateway.requests
      set status = input.kind,
          result = input.result::json,
          prompt_tokens = input.prompt_tokens,
          completion_tokens = input.completion_tokens,
          total_tokens = input.total_tokens,
          last_error_code = coalesce(input.code, requests.last_error_code),
          finished_at = case when input.kind = 'retrying' then null else now() end,
          next_attempt_at = case when input.kind = 'retrying'
                                 then now() + input.delay_ms * interval '1 millisecond' end,
          updated_at = now()
      from input
      where requests.id = input.id and requests.attempts = input.attempt and requests.status = 'processing'
      returning requests.id, requests.status, requests.next_attempt_at, requests.lane_id,
                -- (estimated as gateway.claim_lane estimates it: sql/000008.sql)
                requests.total_tokens
                  - coalesce(requests.prompt_tokens_estimate, octet_length(requests.body::text) / 4) as unestimated_tokens,
                input.pause_ms
    ), lane_lessons as (
      select lane_id, max(pause_ms) as pause_ms, coalesce(sum(unestimated_tokens), 0) as unestimated_tokens
      from finished
      where pause_ms is not null or unestimated_tokens is not null
      group by lane_id
    ), lanes_taught as (
      update gateway.lanes
      set paused_until = case when lane_lessons.pause_ms is null then lanes.paused_until
                              else greatest(lanes.paused_until, now() + lane_lessons.pause_ms * interval '1 millisecond') end,
          token_allowance = lanes.token_allowance - lane_lessons.unestimated_tokens
      from lane_lessons
      where lanes.id = lane_lessons.lane_id
        and (lane_lessons.pause_ms is not null or lanes.tokens_per_minute is not null)
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${DISPATCH_LANE}, json_build_object('lane_id', lane_id), null, next_attempt_at,
                   null, null, null, null)::graphile_worker.job_spec
        from finished where status = 'retrying'
      ))
      where exists (select from finished where status = 'retrying')
    )
    select input.ord, finished.id is not null as applied
    from input
    cross join queued
    left join finished on finished.id = input.id
    order by input.ord
  `.execute(db);
  return rows.map((row) => row.applied);
}

/** An attempt left running by a worker that died. */
export interface LostAttempt extends Pick<Selectable<RequestsTable>, 'id' | 'mode'> {
  attempt: Selectable<RequestAttemptsTable>['attempt_number'];
}

/**
 * Attempts still running whose worker is gone: its row in gateway.worker_pools was deleted as
 * dead (or never written), and the attempt started more than `deadAfterMs` ago, so a worker
 * starting up is not mistaken for a dead one. Never those of the workers in `live`.
 */
export async function findLostAttempts(
  db: Db,
  deadAfterMs: number,
  live: readonly string[],
  limit: number,
): Promise<LostAttempt[]> {
  const { rows } = await sql<LostAttempt>`
    select request_attempts.request_id as id, request_attempts.attempt_number as attempt, requests.mode
    from gateway.request_attempts
    join gateway.requests on requests.id = request_attempts.request_id
    where request_attempts.outcome = 'running'
      and request_attempts.started_at < now() - ${deadAfterMs}::float8 * interval '1 millisecond'
      and not exists (select from gateway.worker_pools where worker_pools.id = request_attempts.worker_id)
      and coalesce(request_attempts.worker_id, '') <> all(${live}::text[])
    limit ${limit}
  `.execute(db);
  return rows;
}

/** The lane of a request that is still waiting or running; undefined otherwise. */
export async function findRequestLane(db: Db, id: string): Promise<string | undefined> {
  const row = await db
    .selectFrom('requests')
    .select('lane_id')
    .where('id', '=', id)
    .where('finished_at', 'is', null)
    .executeTakeFirst();
  return row?.lane_id ?? undefined;
}

/** Of these requests, those that have ended. */
export async function findEnded(db: Db, ids: readonly string[]): Promise<string[]> {
  const { rows } = await sql<Pick<Selectable<RequestsTable>, 'id'>>`
    select id from gateway.requests where id = any(${ids}::text[]) and finished_at is not null
  `.execute(db);
  return rows.map((row) => row.id);
}
