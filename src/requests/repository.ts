// SQL for requests and their attempts. Each function is one statement (so one round trip and
// its own transaction) unless it takes a transaction from its caller.
import { sql } from 'kysely';
import type { RequestStatus } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';
import { NONCE_KEPT_SECONDS, type Nonce } from '../keys/repository.ts';
import type { Usage } from '../upstream/outcome.ts';
import { DISPATCH_LANE } from '../lanes/jobs.ts';

export interface NewRequest {
  id: string;
  project_id: string;
  mode: KeyMode;
  api_key_id: string;
  model: string;
  body: string;
  body_sha256: Buffer;
  idempotency_key: string | null;
  /** The lane it was routed to (lanes/routing.ts). */
  lane_id: string;
  /** Prompt tokens estimated, for a lane with tokens_per_minute. */
  prompt_tokens_estimate: number | null;
}

/** What a submission is answered with: enough for the acknowledgement and the 200. */
export interface RequestAnswer {
  id: string;
  status: RequestStatus;
  created_at: Date;
  /** The result as stored, verbatim JSON text; null unless completed. */
  result: string | null;
  body_sha256: Buffer;
}

/** A request as the API reads it back: for lookups and for answering submissions. */
export interface RequestRow extends RequestAnswer {
  project_id: string;
  mode: KeyMode;
  attempts: number;
  updated_at: Date;
  last_error_code: string | null;
}

export type InsertResult =
  | { kind: 'inserted'; answer: RequestAnswer }
  /** The nonce was already used by this key: nothing was stored. */
  | { kind: 'replayed_nonce' }
  /** The idempotency key is taken in this project and mode: only the nonce was stored. */
  | { kind: 'idempotency_key_taken' };

/**
 * Stores a group of requests in one statement, and so one commit: the nonces of those that
 * were signed, and the requests whose nonce was new (or that had none), each queued in its lane.
 * One add_jobs call wakes each lane of the group (graphile-worker's NOTIFY, taken once per
 * commit, is what limits one-request transactions), unless the lane waits for its limits anyway
 * and has its dispatch scheduled (lanes.wake_at). A nonce and its request are stored together or
 * not at all. Returns one result per item, in order.
 */
export async function insertRequests(
  db: Db,
  items: readonly { request: NewRequest; nonce: Nonce | undefined }[],
): Promise<InsertResult[]> {
  const column = <T>(pick: (item: (typeof items)[number]) => T) => items.map(pick);
  const { rows } = await sql<{
    ord: string;
    nonce_accepted: boolean;
    id: string | null;
    status: RequestStatus | null;
    created_at: Date | null;
  }>`
    with input as (
      select * from unnest(
        ${column((i) => i.request.id)}::text[],
        ${column((i) => i.request.project_id)}::bigint[],
        ${column((i) => i.request.mode)}::text[],
        ${column((i) => i.request.api_key_id)}::text[],
        ${column((i) => i.request.model)}::text[],
        ${column((i) => i.request.body)}::text[],
        ${column((i) => i.request.body_sha256)}::bytea[],
        ${column((i) => i.request.idempotency_key)}::text[],
        ${column((i) => i.request.lane_id)}::bigint[],
        ${column((i) => i.request.prompt_tokens_estimate)}::int[],
        ${column((i) => i.nonce?.nonce ?? null)}::text[]
      ) with ordinality as t(id, project_id, mode, api_key_id, model, body, body_sha256, idempotency_key,
                              lane_id, prompt_tokens_estimate, nonce, ord)
    ), nonces as (
      insert into gateway.signature_nonces (api_key_id, nonce, expires_at)
      select api_key_id, nonce, now() + ${NONCE_KEPT_SECONDS} * interval '1 second' from input where nonce is not null
      on conflict do nothing
      returning api_key_id, nonce
    ), accepted as (
      select input.* from input
      where input.nonce is null
         or exists (select from nonces where nonces.api_key_id = input.api_key_id and nonces.nonce = input.nonce)
    ), inserted as (
      insert into gateway.requests
        (id, project_id, mode, api_key_id, model, body, body_sha256, idempotency_key, lane_id,
         prompt_tokens_estimate, next_attempt_at)
      select id, project_id, mode, api_key_id, model, body::json, body_sha256, idempotency_key, lane_id,
             prompt_tokens_estimate, now()
      from accepted
      on conflict (project_id, mode, idempotency_key) where idempotency_key is not null do nothing
      returning id, status, created_at, lane_id
    ), woken as (
      select distinct inserted.lane_id from inserted
      where not exists (select from gateway.lanes where lanes.id = inserted.lane_id and lanes.wake_at > now())
    ), jobs as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${DISPATCH_LANE}, json_build_object('lane_id', lane_id), null, null, null, null, null, null)::graphile_worker.job_spec
        from woken
      ))
      where exists (select from woken)
    )
    -- Joined to the jobs, so that add_jobs runs (once, for all) whenever a lane is to be woken.
    select input.ord, accepted.id is not null as nonce_accepted, inserted.id, inserted.status, inserted.created_at
    from input
    cross join jobs
    left join accepted on accepted.ord = input.ord
    left join inserted on inserted.id = input.id
    order by input.ord
  `.execute(db);
  return rows.map((row, index): InsertResult => {
    if (!row.nonce_accepted) return { kind: 'replayed_nonce' };
    if (row.id === null) return { kind: 'idempotency_key_taken' };
    return {
      kind: 'inserted',
      answer: {
        id: row.id,
        status: row.status!,
        created_at: row.created_at!,
        result: null,
        body_sha256: items[index]!.request.body_sha256,
      },
    };
  });
}

const answerColumns = sql`id, status, created_at, result::text as result, body_sha256`;

export async function findAnswerByIdempotencyKey(
  db: Db,
  scope: { project_id: string; mode: KeyMode },
  idempotencyKey: string,
): Promise<RequestAnswer | undefined> {
  const { rows } = await sql<RequestAnswer>`
    select ${answerColumns} from gateway.requests
    where project_id = ${scope.project_id} and mode = ${scope.mode} and idempotency_key = ${idempotencyKey}
  `.execute(db);
  return rows[0];
}

/** A request as findRequests reads it: its result left out (null) when larger than asked for. */
export interface RequestHead extends RequestRow {
  /** The size of its stored result (the JSON text, in bytes); null without one. */
  result_bytes: number | null;
}

/**
 * Requests by id, in the order asked (undefined for an id not found). Concurrent lookups are
 * read together (requests/reads.ts): one query, one round trip for all of them. Only the ids are
 * in the WHERE clause, so only the primary key can serve it; callers check the scope. A result
 * larger than `inlineResultBytes` is left out, for findResults to read apart.
 */
export async function findRequests(
  db: Db,
  ids: readonly string[],
  inlineResultBytes = Number.MAX_SAFE_INTEGER,
): Promise<(RequestHead | undefined)[]> {
  // (The size is taken once per row, which offset 0 ensures: each time reads the whole result.)
  const { rows } = await sql<RequestHead>`
    select id, project_id, mode, status, attempts, created_at, updated_at, last_error_code, body_sha256,
           size.result_bytes,
           case when size.result_bytes <= ${inlineResultBytes}::bigint then result::text end as result
    from gateway.requests
    cross join lateral (select octet_length(requests.result::text) as result_bytes offset 0) as size
    where id = any(${ids}::text[])
  `.execute(db);
  const byId = new Map(rows.map((row) => [row.id, row]));
  return ids.map((id) => byId.get(id));
}

/** The stored results (JSON text) of these requests, in the order asked; undefined for a request gone. */
export async function findResults(db: Db, ids: readonly string[]): Promise<(string | null | undefined)[]> {
  const { rows } = await sql<{ id: string; result: string | null }>`
    select id, result::text as result from gateway.requests where id = any(${ids}::text[])
  `.execute(db);
  const byId = new Map(rows.map((row) => [row.id, row.result]));
  return ids.map((id) => byId.get(id));
}

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

// ---------------------------------------------------------------------------------------------
// The worker's side: recording how attempts ended (they are started by gateway.claim_lane, see
// lanes/repository.ts), and finding those whose worker died.

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
                -- (estimated as the claim did: lanes/repository.ts)
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

/**
 * Attempts still running whose worker is gone: its row in gateway.worker_pools was deleted as
 * dead (or never written), and the attempt started more than `deadAfterMs` ago, so a worker
 * starting up is not mistaken for a dead one. Never those of the workers in `live`.
 */
export async function findLostAttempts(db: Db, deadAfterMs: number, live: readonly string[], limit: number) {
  const { rows } = await sql<{ id: string; attempt: number; mode: KeyMode }>`
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

// ---------------------------------------------------------------------------------------------
// Retention. Request ids sort by creation time, so "created before" is a primary-key range.

/** Deletes up to `limit` finished requests created before `cutoffId` (and their attempts). */
export async function deleteFinishedBefore(db: Db, cutoffId: string, limit: number): Promise<number> {
  const { rows } = await sql<{ deleted: string }>`
    with doomed as (
      select id from gateway.requests
      where id < ${cutoffId} and status in ('completed', 'failed', 'cancelled')
      order by id
      limit ${limit}
      for update skip locked
    ), deleted as (
      delete from gateway.requests using doomed where requests.id = doomed.id
      returning 1
    )
    select count(*) as deleted from deleted
  `.execute(db);
  return Number(rows[0]?.deleted ?? 0);
}

/**
 * Drops the bodies of finished requests among the next `limit` ids after the task's cursor and
 * before `cutoffId`, keeping the records, and moves the cursor past them. A request of the batch
 * not finished yet holds the cursor before it, so that its body is dropped in a later run, once
 * it has finished; unless it was created before `holdSince`: one unfinished for that long (a day
 * past the cutoff) is passed over, rather than holding the task back for good. Returns the bodies
 * dropped and whether to go on (a full batch, the cursor not held).
 */
export async function dropBodiesBefore(
  db: Db,
  cutoffId: string,
  holdSince: Date,
  limit: number,
): Promise<{ dropped: number; more: boolean }> {
  const { rows } = await sql<{ dropped: string; scanned: string; held: boolean }>`
    with cursor as (
      select coalesce(
        (select last_request_id from gateway.retention_cursors where task = 'drop_bodies'), 'req_') as last_id
    ), batch as (
      select requests.id, requests.finished_at is not null as finished, requests.created_at
      from gateway.requests, cursor
      where requests.id > cursor.last_id and requests.id < ${cutoffId}
      order by requests.id
      limit ${limit}
    ), held as (
      select min(batch.id) as id from batch where not batch.finished and batch.created_at >= ${holdSince}
    ), dropped as (
      update gateway.requests set body = null
      where requests.id in (select batch.id from batch where batch.finished)
        and requests.finished_at is not null and requests.body is not null
      returning 1
    ), passed as (
      select max(batch.id) as id from batch, held where held.id is null or batch.id < held.id
    ), moved as (
      insert into gateway.retention_cursors (task, last_request_id)
      select 'drop_bodies', passed.id from passed where passed.id is not null
      on conflict (task) do update set last_request_id = excluded.last_request_id
    )
    select (select count(*) from dropped) as dropped, (select count(*) from batch) as scanned,
           (select id from held) is not null as held
  `.execute(db);
  const row = rows[0];
  return { dropped: Number(row?.dropped ?? 0), more: Number(row?.scanned ?? 0) === limit && !row?.held };
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
  const { rows } = await sql<{ id: string }>`
    select id from gateway.requests where id = any(${ids}::text[]) and finished_at is not null
  `.execute(db);
  return rows.map((row) => row.id);
}
