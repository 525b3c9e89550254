// SQL for queues and lanes (sql/000008.sql, sql/000012.sql): a model's queue, where its requests
// wait; its deployments' lanes; starting attempts on them within their health and limits
// (gateway.claim_queue); and the lanes' state for operators.
import { sql, type Selectable } from 'kysely';
import type { Database } from '../db/database.ts';
import { LARGE_BODY_BYTES } from '../db/batcher.ts';
import type { Db } from '../db/pool.ts';
import { statement } from '../db/statement.ts';
import type { KeyMode } from '../ids.ts';
import { DISPATCH_QUEUE } from './jobs.ts';
import type { LaneLimits } from '../upstream/upstreams.ts';

export interface QueueKey {
  mode: KeyMode;
  model: string;
}

export interface Queue extends QueueKey {
  /** int8, as node-postgres returns it. */
  id: string;
}

// pg_advisory_xact_lock key for "create a queue for a model only a pattern serves", which
// gateway.create_pattern_queue (sql/000021.sql) takes: an arbitrary constant, fixed forever
// (db/migrate.ts has the one before it). test/lanes/pattern-models.test.ts holds it.
export const PATTERN_QUEUES_LOCK = 7_242_318_002;

/**
 * The queue's id, its row created on first use (concurrent first uses agree on one row); its
 * use is recorded (queues.used_at), which keeps it from being pruned for a while.
 */
export async function ensureQueue(db: Db, key: QueueKey): Promise<string> {
  const { rows } = await sql<Pick<Selectable<Database['queues']>, 'id'>>`
    insert into gateway.queues (mode, model) values (${key.mode}, ${key.model})
    on conflict (mode, model) do update set used_at = now()
    returning id
  `.execute(db);
  return rows[0]!.id;
}

/** The queue's id, its use recorded (queues.used_at); undefined when it has no row. */
export async function useQueue(db: Db, key: QueueKey): Promise<string | undefined> {
  const { rows } = await sql<Pick<Selectable<Database['queues']>, 'id'>>`
    update gateway.queues set used_at = now() where mode = ${key.mode} and model = ${key.model} returning id
  `.execute(db);
  return rows[0]?.id;
}

/**
 * The queue of a model that only a pattern serves, as ensureQueue gives it; but a new one only
 * while fewer than `max` queues of the mode are for models that `named` does not hold (the
 * models the configuration lists by name): undefined when it would be one too many. One
 * statement (gateway.create_pattern_queue, sql/000021.sql): creations take their turns behind an
 * advisory lock (PATTERN_QUEUES_LOCK), held until the transaction ends, so that the bound holds
 * across processes. A caller looks for the queue with useQueue first, and creates it in the
 * transaction that stores its first request (lanes/routing.ts): the lock lasts that insert too.
 */
export async function createPatternQueue(
  db: Db,
  key: QueueKey,
  bound: { max: number; named: readonly string[] },
): Promise<string | undefined> {
  const { rows } = await sql<{ id: string | null }>`
    select gateway.create_pattern_queue(${key.mode}, ${key.model}, ${bound.max}::int, ${bound.named}::text[]) as id
  `.execute(db);
  return rows[0]!.id ?? undefined;
}

export async function findQueue(db: Db, id: string): Promise<Queue | undefined> {
  return db.selectFrom('queues').select(['id', 'mode', 'model']).where('id', '=', id).executeTakeFirst();
}

/** The queue of a lane (a dispatch_lane job, queued before queues existed, names a lane). */
export async function findLaneQueue(db: Db, laneId: string): Promise<string | undefined> {
  const row = await db.selectFrom('lanes').select('queue_id').where('id', '=', laneId).executeTakeFirst();
  return row?.queue_id;
}

/**
 * The lanes of the queue on these upstreams, its deployments in this order, their rows created
 * on first use (and numbered so: the claim numbers them again as it walks them). The rows there
 * are locked first, in the order of their ids, as the claim and the recording of attempts' ends
 * lock them: updated in the order of the deployments, they could wait in a circle with either.
 */
export async function ensureLanes(db: Db, queue: Queue, upstreams: readonly string[]): Promise<string[]> {
  if (upstreams.length === 0) return [];
  const { rows } = await sql<Pick<Selectable<Database['lanes']>, 'id' | 'upstream'>>`
    with locked as (
      select lanes.id from gateway.lanes
      where lanes.mode = ${queue.mode} and lanes.model = ${queue.model} and lanes.upstream = any(${upstreams}::text[])
      order by lanes.id
      for update
    )
    insert into gateway.lanes (mode, upstream, model, queue_id, deployment)
    select ${queue.mode}, upstream, ${queue.model}, ${queue.id}::bigint, deployment
    from unnest(${upstreams}::text[]) with ordinality as listed(upstream, deployment)
    -- (an InitPlan, run before the first row is inserted: the locks are taken before any)
    where (select count(*) from locked) >= 0
    on conflict (mode, upstream, model) do update set queue_id = excluded.queue_id, deployment = excluded.deployment
    returning id, upstream
  `.execute(db);
  const ids = new Map(rows.map((row) => [row.upstream, row.id]));
  return upstreams.map((upstream) => ids.get(upstream)!);
}

/** An attempt a claim started: the request, the attempt's number, the lane it runs on, and the body to send. */
export interface StartedAttempt {
  id: string;
  attempt: number;
  /** It is its lane's probe: the lane was open, and is probing now. */
  probe: boolean;
  /** Attempts charged to the request before this one (MAX_ATTEMPTS counts these). */
  charged: number;
  laneId: string;
  /**
   * JSON text of the upstream body; undefined for one of more than LARGE_BODY_BYTES, which the
   * claim leaves out, for the worker to read apart (worker/attempts.ts).
   */
  body: string | undefined;
}

/**
 * Room for one call that a worker reserved for a request about to be accepted in its process:
 * the accept may start the request's attempt on `laneId` itself (requests/insert-repository.ts).
 */
export interface StartReservation {
  laneId: string;
  /** The worker the attempt is recorded for. */
  workerId: string;
  /** The accept stored the request with its first attempt started: its call starts now. */
  start(requestId: string, body: string): void;
  /** The accept did not start it (or failed): the room is given back. Nothing once started. */
  release(): void;
}

export interface QueueClaim {
  started: StartedAttempt[];
  /** Requests that are due are still waiting in the queue. */
  waiting: boolean;
  /**
   * How long from the claim until a lane has room again, if only time gives it (limits, a pause,
   * a probe: a dispatch is scheduled for then), in milliseconds; undefined when one has room now,
   * or only finishing calls make room. A span, not a time: the database's clock is not this
   * process's.
   */
  roomInMs: number | undefined;
  /**
   * Lanes the claim opened again because their probe ended without a word (its request was
   * cancelled, failed for its deadline or lost its worker during the call), each with its last error.
   */
  reopened: { laneId: string; lastError: string | null }[];
}

/** A lane of a queue's deployments, in the order they are preferred, with its limits. */
export interface DeploymentLane {
  laneId: string;
  limits: LaneLimits;
}

/**
 * How close to its limits a lane runs. A call reaches the upstream a moment after it is admitted,
 * and not always in the order admitted (a worker's event loop busy for a moment, a connection
 * being opened), so a lane paced exactly at its limits would meet a 429 now and then. It is paced
 * at 95 % of them, and starts at most half a second's worth of its requests_per_minute (and
 * tokens_per_minute) at once. Against a provider's bucket of one second of calls, a call may then
 * arrive about half a second late against those after it and still find room, and 50 ms more for
 * every second the lane has run at its pace. Only a cold lane's first moment pays for it: the
 * rate it keeps is the same.
 */
export const LANE_PACING = Object.freeze({ pace: 0.95, burstSeconds: 0.5 });

const claimStatement = statement(
  ['queue_id', 'max', 'worker_id', 'lane_ids', 'max_concurrent', 'requests_per_minute', 'tokens_per_minute'] as const,
  (v) => sql<{
    request_id: string | null;
    attempt: number | null;
    charged: number | null;
    body: string | null;
    lane_id: string | null;
    probe: boolean | null;
    waiting: boolean | null;
    room_in_ms: number | null;
    lane_changes: { lane_id: string; last_error: string | null }[] | null;
  }>`
    select request_id, attempt, charged, body, lane_id, probe, waiting,
           extract(epoch from room_at - now())::float8 * 1000 as room_in_ms, lane_changes
    from gateway.claim_queue(${v.queue_id}::bigint, ${v.max}::int, ${v.worker_id}::text, ${v.lane_ids}::bigint[],
                             ${v.max_concurrent}::int[], ${v.requests_per_minute}::int[], ${v.tokens_per_minute}::int[],
                             ${sql.lit(LANE_PACING.pace)}::float8, ${sql.lit(LANE_PACING.burstSeconds)}::float8,
                             ${sql.lit(LARGE_BODY_BYTES)}::int)
    cross join (select set_config('synchronous_commit', 'off', true)) as commit_without_flush
  `,
);

/**
 * Starts up to `max` attempts of the queue for `workerId` on its lanes, the first preferred,
 * each within its health and limits, in the projects' turns. Each comes with its body, unless it
 * is a large one: reading megabytes out of Postgres takes a while, and the claim's other calls
 * would wait for it.
 *
 * The claim's transaction commits without waiting for its WAL to reach the disk
 * (synchronous_commit off for it alone): nobody is told of a claim, the worker only calls the
 * upstream, and the commit that records the call's outcome waits for the flush, which takes the
 * claim's WAL with it (the log is written in order). Only a crash of Postgres in the moment
 * between can lose a claim; its request is then waiting again, the outcome's recording finds its
 * attempt gone (stale), and the request is called again, as after a worker lost. Run on the pool,
 * not in a caller's transaction, which would commit so too.
 */
export async function claimQueue(
  db: Db,
  queueId: string,
  max: number,
  workerId: string,
  lanes: readonly DeploymentLane[],
): Promise<QueueClaim> {
  const limit = (pick: (limits: LaneLimits) => number | undefined) => lanes.map((lane) => pick(lane.limits) ?? null);
  const { rows } = await claimStatement.execute(db, {
    queue_id: queueId,
    max,
    worker_id: workerId,
    lane_ids: lanes.map((lane) => lane.laneId),
    max_concurrent: limit((limits) => limits.maxConcurrent),
    requests_per_minute: limit((limits) => limits.requestsPerMinute),
    tokens_per_minute: limit((limits) => limits.tokensPerMinute),
  });
  const summary = rows.at(-1)!;
  return {
    started: rows.slice(0, -1).map((row) => ({
      id: row.request_id!,
      attempt: row.attempt!,
      charged: row.charged!,
      laneId: row.lane_id!,
      probe: row.probe!,
      body: row.body ?? undefined,
    })),
    waiting: summary.waiting ?? false,
    roomInMs: summary.room_in_ms ?? undefined,
    reopened: (summary.lane_changes ?? []).map((change) => ({ laneId: change.lane_id, lastError: change.last_error })),
  };
}

/** Wakes the queue: a dispatch_queue job due now, for whichever worker fetches it first. */
export async function addDispatch(db: Db, queueId: string): Promise<void> {
  await sql`select graphile_worker.add_job(${DISPATCH_QUEUE}, json_build_object('queue_id', ${queueId}::bigint))`.execute(db);
}

export type LaneHealth = 'healthy' | 'open' | 'probing' | 'unlisted' | 'no_upstream';

/** A row of gateway.lane_states: a lane with what it holds now (or a model no lane serves: id and upstream null). */
export interface LaneState {
  id: string | null;
  mode: KeyMode;
  upstream: string | null;
  model: string;
  waiting: number;
  running: number;
  max_concurrent: number | null;
  requests_per_minute: number | null;
  tokens_per_minute: number | null;
  paused_until: Date | null;
  next_dispatch_at: Date | null;
  health: LaneHealth;
  health_since: Date | null;
  last_error: string | null;
  last_error_at: Date | null;
  next_probe_at: Date | null;
  deployment: number | null;
}

export async function laneStates(db: Db): Promise<LaneState[]> {
  const { rows } = await sql<Omit<LaneState, 'waiting' | 'running'> & { waiting: string; running: string }>`
    select * from gateway.lane_states order by mode, model, deployment nulls last, upstream
  `.execute(db);
  return rows.map((row) => ({ ...row, waiting: Number(row.waiting), running: Number(row.running) }));
}
