// SQL for requests and their attempts. Each function is one statement (so one round trip and
// its own transaction) unless it takes a transaction from its caller.
import { sql } from 'kysely';
import type { RequestStatus } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';
import { PROCESS_REQUEST } from './jobs.ts';

export interface NewRequest {
  id: string;
  project_id: string;
  mode: KeyMode;
  api_key_id: string;
  model: string;
  body: string;
  body_sha256: Buffer;
  idempotency_key: string | null;
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

/** The lookup record of GET /v1/requests/{id}. */
export interface RequestRecord {
  id: string;
  status: RequestStatus;
  attempts: number;
  created_at: Date;
  updated_at: Date;
  last_error_code: string | null;
  result: unknown;
}

/** A signed POST's nonce, to be recorded with the request it carried. */
export interface Nonce {
  api_key_id: string;
  nonce: string;
  expires_at: Date;
}

export type InsertResult =
  | { kind: 'inserted'; answer: RequestAnswer }
  /** The nonce was already used by this key: nothing was stored. */
  | { kind: 'replayed_nonce' }
  /** The idempotency key is taken in this project and mode: only the nonce was stored. */
  | { kind: 'idempotency_key_taken' };

/**
 * Stores a group of requests in one statement, and so one commit: the nonces of those that
 * were signed, the requests whose nonce was new (or that had none), and one add_jobs call for
 * all their first jobs (graphile-worker's NOTIFY, taken once per commit, is what limits
 * one-request transactions). A nonce and its request are stored together or not at all.
 * Returns one result per item, in order.
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
        ${column((i) => i.nonce?.nonce ?? null)}::text[],
        ${column((i) => i.nonce?.expires_at ?? null)}::timestamptz[]
      ) with ordinality as t(id, project_id, mode, api_key_id, model, body, body_sha256, idempotency_key,
                              nonce, nonce_expires_at, ord)
    ), nonces as (
      insert into gateway.signature_nonces (api_key_id, nonce, expires_at)
      select api_key_id, nonce, nonce_expires_at from input where nonce is not null
      on conflict do nothing
      returning api_key_id, nonce
    ), accepted as (
      select input.* from input
      where input.nonce is null
         or exists (select from nonces where nonces.api_key_id = input.api_key_id and nonces.nonce = input.nonce)
    ), inserted as (
      insert into gateway.requests
        (id, project_id, mode, api_key_id, model, body, body_sha256, idempotency_key)
      select id, project_id, mode, api_key_id, model, body::json, body_sha256, idempotency_key from accepted
      on conflict (project_id, mode, idempotency_key) where idempotency_key is not null do nothing
      returning id, status, created_at
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${PROCESS_REQUEST}, json_build_object('request_id', id, 'attempt', 1),
                   null, null, null, null, null, null)::graphile_worker.job_spec
        from inserted
      ))
      where exists (select from inserted)
    )
    select input.ord, accepted.id is not null as nonce_accepted,
           inserted.id, inserted.status, inserted.created_at
    from input
    cross join queued
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

export async function findAnswer(db: Db, id: string): Promise<RequestAnswer | undefined> {
  const { rows } = await sql<RequestAnswer>`select ${answerColumns} from gateway.requests where id = ${id}`.execute(db);
  return rows[0];
}

export async function findRecord(
  db: Db,
  scope: { project_id: string; mode: KeyMode },
  id: string,
): Promise<RequestRecord | undefined> {
  return db
    .selectFrom('requests')
    .select(['id', 'status', 'attempts', 'created_at', 'updated_at', 'last_error_code', 'result'])
    .where('id', '=', id)
    .where('project_id', '=', scope.project_id)
    .where('mode', '=', scope.mode)
    .executeTakeFirst();
}

// ---------------------------------------------------------------------------------------------
// The worker's side: claiming an attempt and recording how it ended.

export interface ClaimedAttempt {
  id: string;
  mode: KeyMode;
  /** JSON text of the upstream body. */
  body: string;
  attempt: number;
}

/**
 * Starts attempt `attempt` of a request that is waiting for exactly that attempt (queued or
 * retrying, with attempt - 1 attempts made): marks it processing and records the attempt.
 */
export async function claimAttempt(
  db: Db,
  id: string,
  attempt: number,
  workerId: string | null,
): Promise<ClaimedAttempt | undefined> {
  const { rows } = await sql<ClaimedAttempt>`
    with claimed as (
      update gateway.requests
      set status = 'processing', attempts = attempts + 1, next_attempt_at = null, updated_at = now()
      where id = ${id} and attempts = ${attempt - 1} and status in ('queued', 'retrying')
      returning id, mode, body::text as body, attempts as attempt
    ), recorded as (
      insert into gateway.request_attempts (request_id, attempt_number, worker_id)
      select id, attempt, ${workerId} from claimed
    )
    select id, mode, body, attempt from claimed
  `.execute(db);
  return rows[0];
}

export async function findProgress(
  db: Db,
  id: string,
): Promise<{ status: RequestStatus; attempts: number; mode: KeyMode } | undefined> {
  return db.selectFrom('requests').select(['status', 'attempts', 'mode']).where('id', '=', id).executeTakeFirst();
}

export interface AttemptReport {
  upstreamStatus: number | null;
  durationMs: number | null;
}

export interface AttemptFailure extends AttemptReport {
  code: string;
  detail: string;
}

// Every finishing statement is guarded twice: the attempt must still be running, and the
// request must still be processing this very attempt. A worker that was presumed dead and
// comes back late therefore changes nothing.
const finishAttemptRow = (
  id: string,
  attempt: number,
  outcome: 'succeeded' | 'failed',
  report: AttemptReport,
  failure?: AttemptFailure,
) => sql`
  update gateway.request_attempts
  set outcome = ${outcome}, finished_at = now(), upstream_status = ${report.upstreamStatus},
      duration_ms = ${report.durationMs}, error_code = ${failure?.code ?? null},
      error_detail = ${failure?.detail ?? null}
  where request_id = ${id} and attempt_number = ${attempt} and outcome = 'running'
`;

/** Returns false when the attempt was no longer the request's current one (nothing changed). */
export async function completeAttempt(
  db: Db,
  id: string,
  attempt: number,
  result: string,
  report: AttemptReport,
): Promise<boolean> {
  const { rows } = await sql`
    with attempt as (${finishAttemptRow(id, attempt, 'succeeded', report)})
    update gateway.requests
    set status = 'completed', result = ${result}::json, finished_at = now(), updated_at = now()
    where id = ${id} and attempts = ${attempt} and status = 'processing'
    returning id
  `.execute(db);
  return rows.length === 1;
}

export async function failAttempt(db: Db, id: string, attempt: number, failure: AttemptFailure): Promise<boolean> {
  const { rows } = await sql`
    with attempt as (${finishAttemptRow(id, attempt, 'failed', failure, failure)})
    update gateway.requests
    set status = 'failed', last_error_code = ${failure.code}, finished_at = now(), updated_at = now()
    where id = ${id} and attempts = ${attempt} and status = 'processing'
    returning id
  `.execute(db);
  return rows.length === 1;
}

/** Records the failure, moves the request to retrying and adds the job for the next attempt. */
export async function retryAttempt(
  db: Db,
  id: string,
  attempt: number,
  failure: AttemptFailure,
  delayMs: number,
): Promise<boolean> {
  const { rows } = await sql`
    with attempt as (${finishAttemptRow(id, attempt, 'failed', failure, failure)}),
    retrying as (
      update gateway.requests
      set status = 'retrying', last_error_code = ${failure.code}, updated_at = now(),
          next_attempt_at = now() + ${delayMs}::float8 * interval '1 millisecond'
      where id = ${id} and attempts = ${attempt} and status = 'processing'
      returning id, next_attempt_at
    )
    select retrying.id
    from retrying,
      lateral graphile_worker.add_job(${PROCESS_REQUEST},
        json_build_object('request_id', retrying.id, 'attempt', ${attempt + 1}::int),
        run_at => retrying.next_attempt_at) as job
  `.execute(db);
  return rows.length === 1;
}

// ---------------------------------------------------------------------------------------------
// Retention. Request ids sort by creation time, so "created before" is a primary-key range.

/** Deletes up to `limit` finished requests created before `cutoffId` (and their attempts). */
export async function deleteFinishedBefore(db: Db, cutoffId: string, limit: number): Promise<number> {
  const { rows } = await sql<{ deleted: string }>`
    with doomed as (
      select id from gateway.requests
      where id < ${cutoffId} and status in ('completed', 'failed')
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
 * before `cutoffId`, keeping the records; advances the cursor. Returns the bodies dropped and
 * whether ids were left to look at.
 */
export async function dropBodiesBefore(
  db: Db,
  cutoffId: string,
  limit: number,
): Promise<{ dropped: number; more: boolean }> {
  const { rows } = await sql<{ dropped: string; scanned: string }>`
    with cursor as (
      select coalesce(
        (select last_request_id from gateway.retention_cursors where task = 'drop_bodies'), 'req_') as last_id
    ), batch as (
      select id from gateway.requests, cursor
      where id > cursor.last_id and id < ${cutoffId}
      order by id
      limit ${limit}
    ), dropped as (
      update gateway.requests set body = null
      where id in (select id from batch) and status in ('completed', 'failed') and body is not null
      returning 1
    ), moved as (
      insert into gateway.retention_cursors (task, last_request_id)
      select 'drop_bodies', max(id) from batch having count(*) > 0
      on conflict (task) do update set last_request_id = excluded.last_request_id
    )
    select (select count(*) from dropped) as dropped, (select count(*) from batch) as scanned
  `.execute(db);
  return { dropped: Number(rows[0]?.dropped ?? 0), more: Number(rows[0]?.scanned ?? 0) === limit };
}
