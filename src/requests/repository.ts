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
 * Records the nonce (if any), the request and its first job, in one statement: the nonce and
 * the request are stored together or not at all.
 */
export async function insertRequest(db: Db, request: NewRequest, nonce: Nonce | undefined): Promise<InsertResult> {
  const nonceValue = nonce?.nonce ?? null;
  const { rows } = await sql<{ nonce_accepted: boolean } & { [K in keyof RequestAnswer]: RequestAnswer[K] | null }>`
    with nonce as (
      insert into gateway.signature_nonces (api_key_id, nonce, expires_at)
      select ${nonce?.api_key_id ?? null}, ${nonceValue}::text, ${nonce?.expires_at ?? null}::timestamptz
      where ${nonceValue}::text is not null
      on conflict do nothing
      returning nonce
    ), inserted as (
      insert into gateway.requests
        (id, project_id, mode, api_key_id, model, body, body_sha256, idempotency_key)
      select ${request.id}, ${request.project_id}, ${request.mode}, ${request.api_key_id},
             ${request.model}, ${request.body}::json, ${request.body_sha256}, ${request.idempotency_key}
      where ${nonceValue}::text is null or exists (select from nonce)
      on conflict (project_id, mode, idempotency_key) where idempotency_key is not null do nothing
      returning id, status, created_at, body_sha256
    ), queued as (
      select inserted.*
      from inserted,
        lateral graphile_worker.add_job(${PROCESS_REQUEST},
          json_build_object('request_id', inserted.id, 'attempt', 1)) as job
    )
    select ${nonceValue}::text is null or exists (select from nonce) as nonce_accepted,
           queued.id, queued.status, queued.created_at, null as result, queued.body_sha256
    from (values (1)) as one
    left join queued on true
  `.execute(db);
  const row = rows[0]!;
  if (!row.nonce_accepted) return { kind: 'replayed_nonce' };
  if (row.id === null) return { kind: 'idempotency_key_taken' };
  return { kind: 'inserted', answer: row as RequestAnswer };
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
): Promise<{ status: RequestStatus; attempts: number } | undefined> {
  return db.selectFrom('requests').select(['status', 'attempts']).where('id', '=', id).executeTakeFirst();
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
