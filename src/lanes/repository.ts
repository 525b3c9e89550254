// SQL for lanes (sql/000008.sql): finding a lane's row, starting its attempts within its limits
// (gateway.claim_lane), and reading the lanes' state for operators.
import { sql } from 'kysely';
import type { Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';
import { DISPATCH_LANE } from './jobs.ts';
import type { LaneLimits } from '../upstream/upstreams.ts';

export interface LaneKey {
  mode: KeyMode;
  upstream: string;
  model: string;
}

export interface Lane extends LaneKey {
  /** int8, as node-postgres returns it. */
  id: string;
}

/** The lane's id, its row created on first use (concurrent first uses agree on one row). */
export async function ensureLane(db: Db, key: LaneKey): Promise<string> {
  const { rows } = await sql<{ id: string }>`
    insert into gateway.lanes (mode, upstream, model) values (${key.mode}, ${key.upstream}, ${key.model})
    on conflict (mode, upstream, model) do update set model = excluded.model
    returning id
  `.execute(db);
  return rows[0]!.id;
}

export async function findLane(db: Db, id: string): Promise<Lane | undefined> {
  return db.selectFrom('lanes').select(['id', 'mode', 'upstream', 'model']).where('id', '=', id).executeTakeFirst();
}

/** An attempt a claim started: the request, the attempt's number, and the body to send. */
export interface StartedAttempt {
  id: string;
  attempt: number;
  /** JSON text of the upstream body. */
  body: string;
}

export interface LaneClaim {
  started: StartedAttempt[];
  /** Requests that are due are still waiting in the lane. */
  waiting: boolean;
  /**
   * When the lane has room again, if its rate limits or a pause hold them back (a dispatch is
   * scheduled for then); undefined when it has room now, or only finishing calls make room.
   */
  roomAt: Date | undefined;
}

/** Starts up to `max` attempts of the lane for `workerId`, in the projects' turns, within `limits`. */
export async function claimLane(
  db: Db,
  laneId: string,
  max: number,
  workerId: string,
  limits: LaneLimits,
): Promise<LaneClaim> {
  const { rows } = await sql<{
    request_id: string | null;
    attempt: number | null;
    body: string | null;
    waiting: boolean | null;
    room_at: Date | null;
  }>`
    select request_id, attempt, body, waiting, room_at
    from gateway.claim_lane(${laneId}::bigint, ${max}::int, ${workerId}::text, ${limits.maxConcurrent ?? null}::int,
                            ${limits.requestsPerMinute ?? null}::int, ${limits.tokensPerMinute ?? null}::int)
  `.execute(db);
  const summary = rows.at(-1)!;
  return {
    started: rows.slice(0, -1).map((row) => ({ id: row.request_id!, attempt: row.attempt!, body: row.body! })),
    waiting: summary.waiting ?? false,
    roomAt: summary.room_at ?? undefined,
  };
}

/** Wakes the lane: a dispatch_lane job due now, for whichever worker fetches it first. */
export async function addDispatch(db: Db, laneId: string): Promise<void> {
  await sql`select graphile_worker.add_job(${DISPATCH_LANE}, json_build_object('lane_id', ${laneId}::bigint))`.execute(db);
}

/** A row of gateway.lane_states: a lane with what it holds now. */
export interface LaneState extends Lane {
  waiting: number;
  running: number;
  max_concurrent: number | null;
  requests_per_minute: number | null;
  tokens_per_minute: number | null;
  paused_until: Date | null;
  next_dispatch_at: Date | null;
}

export async function laneStates(db: Db): Promise<LaneState[]> {
  const { rows } = await sql<Omit<LaneState, 'waiting' | 'running'> & { waiting: string; running: string }>`
    select * from gateway.lane_states order by mode, upstream, model
  `.execute(db);
  return rows.map((row) => ({ ...row, waiting: Number(row.waiting), running: Number(row.running) }));
}
