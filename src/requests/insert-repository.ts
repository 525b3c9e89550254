// SQL of accepting requests (requests/insert-batcher.ts, requests/service.ts): storing a group of
// submissions with their nonces, each in its model's queue, and finding the answer of a submission
// whose idempotency key was taken before.
import { sql, type Nullable, type RawBuilder, type Selectable } from 'kysely';
import pg from 'pg';
import type { RequestsTable } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import { columnArrays, statement, unnestRows, type InputColumn } from '../db/statement.ts';
import type { KeyMode } from '../ids.ts';
import { NONCE_KEPT_SECONDS, type Nonce } from '../keys/repository.ts';
import { DISPATCH_QUEUE } from '../lanes/jobs.ts';

export interface NewRequest {
  id: string;
  project_id: string;
  mode: KeyMode;
  api_key_id: string;
  model: string;
  body: string;
  body_sha256: Buffer;
  idempotency_key: string | null;
  /** The queue it was routed to (lanes/routing.ts). */
  queue_id: string;
  /** Prompt tokens estimated, when a deployment of its model has tokens_per_minute. */
  prompt_tokens_estimate: number | null;
  /** How long it may take to finish: its deadline_at is its acceptance (now()) plus this. */
  deadline_ms: number;
  /** Its attempt may start in the accept itself, on this lane, for this worker (see insertRequests). */
  start?: { laneId: string; workerId: string } | undefined;
}

/** What a submission is answered with: enough for the acknowledgement and the 200. */
export interface RequestAnswer extends Pick<Selectable<RequestsTable>, 'id' | 'status' | 'created_at' | 'body_sha256'> {
  /** The result as stored, verbatim JSON text; null unless completed. */
  result: string | null;
}

export type InsertResult =
  | { kind: 'inserted'; answer: RequestAnswer }
  /** The nonce was already used by this key: nothing was stored. */
  | { kind: 'replayed_nonce' }
  /** The idempotency key is taken in this project and mode: only the nonce was stored. */
  | { kind: 'idempotency_key_taken' };

/**
 * Stores a group of requests in one statement, and so one commit: the nonces of those that
 * were signed, and the requests whose nonce was new (or that had none), each in its queue.
 * One add_jobs call wakes each queue of the group (graphile-worker's NOTIFY, taken once per
 * commit, is what limits one-request transactions), unless the queue waits for its lanes anyway
 * and has its dispatch scheduled (queues.wake_at). The jobs are due `dispatch.delayMs` from now: at
 * once, unless the caller dispatches the requests itself and they are only its fallback. A
 * fallback is keyed by its queue (`dispatch_fallback:<queue id>`) and keeps the time it is due
 * when added again, so that a queue has one pending however many requests it accepts: one job,
 * due `dispatch.delayMs` after the oldest of them, in place of one job per statement that each runs a
 * claim finding nothing (the process has claimed them). The queues `covered` (their fallback is
 * known to be pending, and not about to run) get no job at all: the statement then makes no
 * add_jobs call, nor its NOTIFY, for them. A nonce and its request are stored together or not at
 * all. Returns one result per item, in order, and when each fallback added is due.
 *
 * A request given a `start` (a wait=true request in a process whose worker reserved room for its
 * call: worker/dispatcher.ts reserveStart) is stored with its first attempt started on that lane,
 * for that worker, when a claim of its queue would start it and nothing else: the lane is healthy
 * and not paused, and no request of the queue is due (a claim takes the longest waiting first, so
 * the new one waits its turn behind them). It saves the claim's round trip on the path of a
 * caller waiting for the answer. Its status is then processing, and it is no reason to wake its
 * queue.
 */
export async function insertRequests(db: Db, items: readonly Item[], dispatch: Dispatch = { delayMs: 0 }): Promise<Inserted> {
  const fallback = dispatch.delayMs > 0;
  const values: Record<StatementValue, unknown> = {
    ...inputValues(items),
    delay_ms: dispatch.delayMs,
    fallback,
    covered: fallback ? (dispatch.covered ?? []) : [],
  };
  const { rows } = await (items.length === 1 ? insertOne : insertGroup).execute(db, values);
  const results = rows.map((row, index): InsertResult => {
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
  return { results, fallbacks: new Map(Object.entries(rows[0]?.fallbacks ?? {})) };
}

type InsertedRow = { ord: string; nonce_accepted: boolean; fallbacks: Record<string, number> | null } & Nullable<
  Pick<Selectable<RequestsTable>, 'id' | 'status' | 'created_at'>
>;

/** The statement, with `input` giving its rows (input.*, ord) from the values of the columns. */
function insertStatement(input: (values: Record<StatementValue, RawBuilder<unknown>>) => RawBuilder<unknown>) {
  return statement(STATEMENT_VALUES, (values) => sql<InsertedRow>`
    with input as (${input(values)}), nonces as (
      insert into gateway.signature_nonces (api_key_id, nonce, expires_at)
      select api_key_id, nonce, now() + ${sql.lit(NONCE_KEPT_SECONDS)} * interval '1 second' from input where nonce is not null
      on conflict do nothing
      returning api_key_id, nonce
    ), accepted as (
      select input.*,
             case when input.start_lane_id is null then false
                  else exists (select from gateway.lanes
                               where lanes.id = input.start_lane_id and lanes.queue_id = input.queue_id
                                 and lanes.health = 'healthy' and not coalesce(lanes.paused_until > now(), false))
                       and not exists (select from gateway.requests as due
                                       where due.queue_id = input.queue_id and due.status in ('queued', 'retrying')
                                         and due.next_attempt_at <= now())
             end as starts
      from input
      where input.nonce is null
         or exists (select from nonces where nonces.api_key_id = input.api_key_id and nonces.nonce = input.nonce)
    ), inserted as (
      insert into gateway.requests
        (id, project_id, mode, api_key_id, model, body, body_bytes, body_sha256, idempotency_key, queue_id,
         prompt_tokens_estimate, status, attempts, lane_id, next_attempt_at, deadline_at)
      select id, project_id, mode, api_key_id, model, body::json, octet_length(body), body_sha256, idempotency_key, queue_id,
             prompt_tokens_estimate,
             case when starts then 'processing' else 'queued' end, case when starts then 1 else 0 end,
             case when starts then start_lane_id end, case when starts then null else now() end,
             now() + deadline_ms * interval '1 millisecond'
      from accepted
      on conflict (project_id, mode, idempotency_key) where idempotency_key is not null do nothing
      returning id, status, created_at, queue_id, lane_id
    ), started as (
      insert into gateway.request_attempts (request_id, attempt_number, worker_id, upstream)
      select inserted.id, 1, accepted.start_worker_id, lanes.upstream
      from inserted
      join accepted on accepted.id = inserted.id
      join gateway.lanes on lanes.id = inserted.lane_id
      where inserted.status = 'processing'
    ), woken as (
      select distinct inserted.queue_id from inserted
      where inserted.status = 'queued'
        and not exists (select from gateway.queues where queues.id = inserted.queue_id and queues.wake_at > now())
        and inserted.queue_id <> all(${values.covered}::bigint[])
    ), jobs as (
      -- Each fallback added (or found, keeping its time), and how many milliseconds until it is due.
      select json_object_agg(added.payload->>'queue_id', extract(epoch from added.run_at - now()) * 1000)
               filter (where added.key is not null) as fallbacks
      from graphile_worker.add_jobs(array(
        select row(${sql.lit(DISPATCH_QUEUE)}, json_build_object('queue_id', queue_id), null,
                   now() + ${values.delay_ms}::float8 * interval '1 millisecond', null,
                   case when ${values.fallback}::boolean then ${sql.lit(FALLBACK_KEY_PREFIX)} || queue_id end, null, null)::graphile_worker.job_spec
        -- In one order, so that statements updating the same queues' fallbacks cannot deadlock.
        from woken order by queue_id
      ), job_key_preserve_run_at => true) as added
      where exists (select from woken)
    )
    -- Joined to the jobs, so that add_jobs runs (once, for all) whenever a queue is to be woken.
    select input.ord, accepted.id is not null as nonce_accepted, inserted.id, inserted.status, inserted.created_at,
           jobs.fallbacks
    from input
    cross join jobs
    left join accepted on accepted.ord = input.ord
    left join inserted on inserted.id = input.id
    order by input.ord
  `);
}

/** How the requests of a statement have their queues dispatched. */
export interface Dispatch {
  /** How long their dispatch jobs wait before they are due: 0, at once; else they are fallbacks. */
  delayMs: number;
  /** Queues whose fallback is known to be pending and not about to run: no job is added for them. */
  covered?: readonly string[] | undefined;
}

export interface Inserted {
  results: InsertResult[];
  /** Each queue given a fallback job (or whose pending one was found): milliseconds until it is due. */
  fallbacks: Map<string, number>;
}

/** The job key of a queue's fallback dispatch: `dispatch_fallback:<queue id>`. */
const FALLBACK_KEY_PREFIX = 'dispatch_fallback:';

type Item = { request: NewRequest; nonce: Nonce | undefined };

/** The columns of the statement's input, each with its type and where an item has it. */
const INPUT_COLUMNS = [
  ['id', 'text', (i: Item) => i.request.id],
  ['project_id', 'bigint', (i: Item) => i.request.project_id],
  ['mode', 'text', (i: Item) => i.request.mode],
  ['api_key_id', 'text', (i: Item) => i.request.api_key_id],
  ['model', 'text', (i: Item) => i.request.model],
  ['body', 'text', (i: Item) => i.request.body],
  ['body_sha256', 'bytea', (i: Item) => i.request.body_sha256],
  ['idempotency_key', 'text', (i: Item) => i.request.idempotency_key],
  ['queue_id', 'bigint', (i: Item) => i.request.queue_id],
  ['prompt_tokens_estimate', 'int', (i: Item) => i.request.prompt_tokens_estimate],
  ['deadline_ms', 'float8', (i: Item) => i.request.deadline_ms],
  ['nonce', 'text', (i: Item) => i.nonce?.nonce ?? null],
  ['start_lane_id', 'bigint', (i: Item) => i.request.start?.laneId ?? null],
  ['start_worker_id', 'text', (i: Item) => i.request.start?.workerId ?? null],
] as const satisfies readonly InputColumn<Item>[];
type ColumnName = (typeof INPUT_COLUMNS)[number][0];

/** The statement's values: one per input column, then how the queues are dispatched. */
const STATEMENT_VALUES = [...INPUT_COLUMNS.map(([name]) => name), 'delay_ms', 'fallback', 'covered'] as const;
type StatementValue = (typeof STATEMENT_VALUES)[number];

/**
 * The input's rows (with their position, ord): a single item as plain parameters, a group as one
 * array per column, unnested. A large body goes alone (insert-batcher.ts), and as a plain
 * parameter Postgres takes its text as it is, where in an array literal both sides would escape
 * and parse every byte of it.
 */
const insertOne = insertStatement(
  (values) => sql`select ${sql.join(INPUT_COLUMNS.map(([name, type]) => sql`${values[name]}::${sql.raw(type)} as ${sql.id(name)}`))}, 1::bigint as ord`,
);
const insertGroup = insertStatement((values) => unnestRows(INPUT_COLUMNS, values));

/** The values of the input's columns: each item's own for one item, an array per column for a group. */
function inputValues(items: readonly Item[]): Record<ColumnName, unknown> {
  if (items.length > 1) return columnArrays(INPUT_COLUMNS, items);
  const only = items[0]!;
  return Object.fromEntries(INPUT_COLUMNS.map(([name, , pick]) => [name, pick(only)])) as Record<ColumnName, unknown>;
}

/**
 * The insert failed because the queue it names no longer exists: it was pruned (idle and empty)
 * after the request was routed to it. Nothing of the statement was stored.
 */
export function isQueueGone(error: unknown): boolean {
  return error instanceof pg.DatabaseError && error.code === '23503' && error.constraint === 'requests_queue_id_fkey';
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
