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

/** A request as the API reads it back: for lookups and for answering submissions. */
export interface RequestRow extends RequestAnswer {
  project_id: string;
  mode: KeyMode;
  attempts: number;
  updated_at: Date;
  last_error_code: string | null;
}

/** A signed POST's nonce, to be recorded with the request it carried. */
export interface Nonce {
  api_key_id: string;
  nonce: string;
  expires_at: Date;
}

/**
 * A request that the accepting process runs itself (a worker in the same process): stored with
 * its first attempt already started by `workerId` (wait=true) or queued for that process to
 * claim next (wait=false), and its job is a lease,
 * due only `leaseMs` from now. If the process dies, the job comes due and a worker recovers
 * the attempt as worker_lost; while the attempt runs, the process pushes the job back
 * (worker/local-attempts.ts); its outcome removes the job.
 */
export interface Lease {
  workerId: string;
  leaseMs: number;
  /** true: stored processing, its first attempt started; false: stored queued, claimed next. */
  started: boolean;
}

export type InsertResult =
  | { kind: 'inserted'; answer: RequestAnswer; leaseJobId?: string }
  /** The nonce was already used by this key: nothing was stored. */
  | { kind: 'replayed_nonce' }
  /** The idempotency key is taken in this project and mode: only the nonce was stored. */
  | { kind: 'idempotency_key_taken' };

/**
 * Stores a group of requests in one statement, and so one commit: the nonces of those that
 * were signed, the requests whose nonce was new (or that had none), and one add_jobs call for
 * all their first jobs (graphile-worker's NOTIFY, taken once per commit, is what limits
 * one-request transactions). A nonce and its request are stored together or not at all.
 * An item with a lease has the lease as its job; if started, it is stored as processing, with
 * its attempt row.
 * Returns one result per item, in order.
 */
export async function insertRequests(
  db: Db,
  items: readonly { request: NewRequest; nonce: Nonce | undefined; lease?: Lease | undefined }[],
): Promise<InsertResult[]> {
  const column = <T>(pick: (item: (typeof items)[number]) => T) => items.map(pick);
  const { rows } = await sql<{
    ord: string;
    nonce_accepted: boolean;
    id: string | null;
    status: RequestStatus | null;
    created_at: Date | null;
    lease_job_id: string | null;
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
        ${column((i) => i.nonce?.expires_at ?? null)}::timestamptz[],
        ${column((i) => i.lease?.workerId ?? null)}::text[],
        ${column((i) => i.lease?.leaseMs ?? null)}::float8[],
        ${column((i) => i.lease?.started ?? false)}::boolean[]
      ) with ordinality as t(id, project_id, mode, api_key_id, model, body, body_sha256, idempotency_key,
                              nonce, nonce_expires_at, lease_worker_id, lease_ms, started, ord)
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
        (id, project_id, mode, api_key_id, model, body, body_sha256, idempotency_key, status, attempts)
      select id, project_id, mode, api_key_id, model, body::json, body_sha256, idempotency_key,
             case when started then 'processing' else 'queued' end,
             case when started then 1 else 0 end
      from accepted
      on conflict (project_id, mode, idempotency_key) where idempotency_key is not null do nothing
      returning id, status, created_at
    ), started as (
      insert into gateway.request_attempts (request_id, attempt_number, worker_id)
      select id, 1, accepted.lease_worker_id
      from inserted join accepted using (id)
      where accepted.started
    ), jobs as (
      select jobs.id as job_id, jobs.payload->>'request_id' as request_id
      from graphile_worker.add_jobs(array(
        select row(${PROCESS_REQUEST}, json_build_object('request_id', id, 'attempt', 1),
                   null, now() + accepted.lease_ms * interval '1 millisecond',
                   null, null, null, null)::graphile_worker.job_spec
        from inserted join accepted using (id)
      )) as jobs
      where exists (select from inserted)
    )
    -- Every inserted row is joined to its job, so add_jobs runs (once, for all) whenever one is.
    select input.ord, accepted.id is not null as nonce_accepted,
           inserted.id, inserted.status, inserted.created_at,
           case when input.lease_worker_id is not null then jobs.job_id end as lease_job_id
    from input
    left join accepted on accepted.ord = input.ord
    left join inserted on inserted.id = input.id
    left join jobs on jobs.request_id = inserted.id
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
      ...(row.lease_job_id === null ? {} : { leaseJobId: row.lease_job_id }),
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

/**
 * Requests by id, in the order asked (undefined for an id not found). Concurrent lookups are
 * read together (see requests/service.ts): one query, one round trip for all of them. Only the
 * ids are in the WHERE clause, so only the primary key can serve it; callers check the scope.
 */
export async function findRequests(db: Db, ids: readonly string[]): Promise<(RequestRow | undefined)[]> {
  const { rows } = await sql<RequestRow>`
    select id, project_id, mode, status, attempts, created_at, updated_at, last_error_code,
           result::text as result, body_sha256
    from gateway.requests
    where id = any(${ids}::text[])
  `.execute(db);
  const byId = new Map(rows.map((row) => [row.id, row]));
  return ids.map((id) => byId.get(id));
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

export interface Claim {
  id: string;
  /** The attempt the job is meant to start (1 for the first). */
  attempt: number;
  workerId: string | null;
}

/**
 * Starts attempts, a group at a time: each request that is waiting for exactly that attempt
 * (queued or retrying, with attempt - 1 attempts made) becomes processing and gets its attempt
 * row. Returns, per claim, the attempt to run, or undefined when the request was not waiting
 * for it (finished, gone, or its attempt already started: the caller finds out which).
 */
export async function claimAttempts(db: Db, claims: readonly Claim[]): Promise<(ClaimedAttempt | undefined)[]> {
  const { rows } = await sql<{ ord: string } & { [K in keyof ClaimedAttempt]: ClaimedAttempt[K] | null }>`
    with input as (
      select * from unnest(
        ${claims.map((c) => c.id)}::text[],
        ${claims.map((c) => c.attempt)}::int[],
        ${claims.map((c) => c.workerId)}::text[]
      ) with ordinality as t(id, attempt, worker_id, ord)
    ), claimed as (
      update gateway.requests
      set status = 'processing', attempts = requests.attempts + 1, next_attempt_at = null, updated_at = now()
      from input
      where requests.id = input.id and requests.attempts = input.attempt - 1
        and requests.status in ('queued', 'retrying')
      returning requests.id, requests.mode, requests.body::text as body, requests.attempts as attempt, input.worker_id
    ), recorded as (
      insert into gateway.request_attempts (request_id, attempt_number, worker_id)
      select id, attempt, worker_id from claimed
    )
    select input.ord, claimed.id, claimed.mode, claimed.body, claimed.attempt
    from input
    left join claimed on claimed.id = input.id
    order by input.ord
  `.execute(db);
  return rows.map((row) => (row.id === null ? undefined : (row as ClaimedAttempt)));
}

/** One claim; see claimAttempts. */
export async function claimAttempt(db: Db, id: string, attempt: number, workerId: string | null) {
  return (await claimAttempts(db, [{ id, attempt, workerId }]))[0];
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

/** How an attempt ended, and so what becomes of its request. */
export type Finish = (
  | ({ kind: 'completed'; id: string; attempt: number; result: string } & AttemptReport)
  | ({ kind: 'failed'; id: string; attempt: number } & AttemptFailure)
  | ({ kind: 'retrying'; id: string; attempt: number; delayMs: number } & AttemptFailure)
) & {
  /** The lease job of an attempt run by its accepting process (see Lease): removed with it. */
  leaseJobId?: string | undefined;
};

/**
 * Records how attempts ended, a group at a time, in one statement: each attempt row, its
 * request (completed, failed, or retrying with its next attempt due), and one add_jobs for
 * the next attempts. Each is guarded twice: the attempt must still be running, and the request
 * still processing this very attempt; so a worker presumed dead that comes back late changes
 * nothing. Lease jobs named are removed whether or not their finish applies (a lease job that a
 * worker has already taken is locked, and left alone). Returns, per finish, whether it was applied.
 */
export async function finishAttempts(db: Db, finishes: readonly Finish[]): Promise<boolean[]> {
  const column = <T>(pick: (finish: Finish) => T) => finishes.map(pick);
  const failure = (finish: Finish) => (finish.kind === 'completed' ? undefined : finish);
  const { rows } = await sql<{ ord: string; applied: boolean }>`
    with input as (
      select * from unnest(
        ${column((f) => f.id)}::text[],
        ${column((f) => f.attempt)}::int[],
        ${column((f) => f.kind)}::text[],
        ${column((f) => (f.kind === 'completed' ? f.result : null))}::text[],
        ${column((f) => failure(f)?.code ?? null)}::text[],
        ${column((f) => failure(f)?.detail ?? null)}::text[],
        ${column((f) => f.upstreamStatus)}::int[],
        ${column((f) => f.durationMs)}::int[],
        ${column((f) => (f.kind === 'retrying' ? f.delayMs : null))}::float8[],
        ${column((f) => f.leaseJobId ?? null)}::bigint[]
      ) with ordinality as t(id, attempt, kind, result, code, detail, upstream_status, duration_ms, delay_ms,
                              lease_job_id, ord)
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
          last_error_code = coalesce(input.code, requests.last_error_code),
          finished_at = case when input.kind = 'retrying' then null else now() end,
          next_attempt_at = case when input.kind = 'retrying'
                                 then now() + input.delay_ms * interval '1 millisecond' end,
          updated_at = now()
      from input
      where requests.id = input.id and requests.attempts = input.attempt and requests.status = 'processing'
      returning requests.id, requests.status, requests.next_attempt_at, input.attempt
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${PROCESS_REQUEST}, json_build_object('request_id', id, 'attempt', attempt + 1),
                   null, next_attempt_at, null, null, null, null)::graphile_worker.job_spec
        from finished where status = 'retrying'
      ))
      where exists (select from finished where status = 'retrying')
    ), leases_ended as (
      select count(*) as jobs
      from graphile_worker.complete_jobs(array(select lease_job_id from input where lease_job_id is not null))
      where exists (select from input where lease_job_id is not null)
    )
    select input.ord, finished.id is not null as applied
    from input
    cross join queued
    cross join leases_ended
    left join finished on finished.id = input.id
    order by input.ord
  `.execute(db);
  return rows.map((row) => row.applied);
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

/** Pushes lease jobs (see Lease) back to `leaseMs` from now; those a worker has taken stay as they are. */
export async function renewLeases(db: Db, jobIds: readonly string[], leaseMs: number): Promise<void> {
  await sql`
    select count(*) from graphile_worker.reschedule_jobs(
      ${jobIds}::bigint[], run_at => now() + ${leaseMs}::float8 * interval '1 millisecond')
  `.execute(db);
}
