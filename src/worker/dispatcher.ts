// The one way an attempt starts. A dispatch of a lane asks Postgres for as many of the lane's
// waiting requests as its limits allow, in its projects' turns (gateway.claim_lane, one
// statement), and starts their upstream calls here. A call in flight holds a socket, a timer and
// a few objects: no database connection and no graphile-worker slot, so a worker process keeps
// thousands in flight, up to MAX_IN_FLIGHT live and TEST_MAX_IN_FLIGHT test calls, each mode in
// capacity of its own.
//
// What dispatches a lane:
// - its dispatch_lane jobs (jobs.ts): added with accepted requests and with retries, and by
//   claim_lane itself for the time a lane waiting for its rate limits or a pause has room again;
// - in a process that also serves the API, the requests it has just accepted (no queue hop);
// - a call of a lane with max_concurrent ending here: the room it leaves is taken by the process
//   that had it (a process waiting for that room elsewhere would never hear of it);
// - room made in this process's capacity, for the lanes that were waiting for it.
// Dispatches of one lane in one process run one at a time: calls that arrive meanwhile share
// the next.
//
// A call whose request ends meanwhile (cancelled, or finished by another worker after this one
// was presumed dead) is aborted as soon as the process hears of it: the requests' ends are
// announced on gateway_requests_finished, and while that LISTEN connection is down the
// dispatcher asks the database about its calls every second instead.
//
// If the process dies, its calls die with it; their attempts stay running in the database until
// the supervisor's sweep finds this worker's heartbeat gone and records them as worker_lost.
import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import { errorSummary, type Db } from '../db/pool.ts';
import { landWithin, type InFlight } from '../grace.ts';
import { whileUnavailable } from '../db/retry.ts';
import type { KeyMode } from '../ids.ts';
import { addDispatch, claimLane, findLane, type Lane, type LaneClaim, type StartedAttempt } from '../lanes/repository.ts';
import { findEnded } from './attempts-repository.ts';
import { modelLabel, NO_LIMITS, SIMULATOR, type LaneLimits, type Upstream } from '../upstream/upstreams.ts';
import type { Logger } from '../logger.ts';
import { ABORTED_AS_ENDED, ABORTED_BY_SHUTDOWN, ABORTED_BY_TIMEOUT, type Attempts, type CallTarget } from './attempts.ts';

export interface DispatcherOptions {
  db: Db;
  attempts: Attempts;
  upstreams: readonly Upstream[];
  /** Calls in flight at most, per mode (MAX_IN_FLIGHT, TEST_MAX_IN_FLIGHT). */
  capacity: Readonly<Record<KeyMode, number>>;
  upstreamTimeoutMs: number;
  /** How long calls in flight may finish at shutdown (SHUTDOWN_GRACE_MS). */
  graceMs: number;
  logger: Logger;
}

// Attempts started by one claim statement at most, and started before the event loop is given a turn.
const CLAIM_BATCH = 500;
const START_SLICE = 50;
// How long a statement is retried while the database is unreachable.
const OUTAGE_PATIENCE_MS = 60_000;
// How often the calls' requests are checked while their ends cannot be heard.
const ENDED_POLL_MS = 1_000;

/** Where a lane's calls go, and its limits. */
interface Route {
  target: CallTarget;
  limits: LaneLimits;
}

interface LaneSlot {
  readonly id: string;
  /** Read once (null: its upstream is not configured here). */
  route: Route | null | undefined;
  /** Dispatches under way or asked for (the loop runs while there are). */
  loop: Promise<void> | undefined;
  /** Callers of dispatch() waiting for the next dispatch to end. */
  waiters: { resolve(): void; reject(error: unknown): void }[];
  poked: boolean;
}

export class Dispatcher {
  /** The worker id of this process's attempts (request_attempts.worker_id), kept alive by its heartbeat. */
  readonly workerId = `worker-${hostname()}-${process.pid}-${randomBytes(4).toString('hex')}`;
  readonly #options: DispatcherOptions;
  readonly #log: Logger;
  readonly #lanes = new Map<string, LaneSlot>();
  /** Lanes whose last dispatch stopped for this process's capacity, by mode. */
  readonly #waitingForCapacity: Record<KeyMode, Set<LaneSlot>> = { live: new Set(), test: new Set() };
  readonly #inFlight: Record<KeyMode, number> = { live: 0, test: 0 };
  /**
   * Room promised to claims under way, by mode: from before a claim until each call it started
   * is in flight. Dispatches of several lanes run at once; without this, each would count the
   * same room free, and together start more calls than the capacity.
   */
  readonly #reserved: Record<KeyMode, number> = { live: 0, test: 0 };
  /** Calls in flight, by request id. */
  readonly #calls = new Map<string, InFlight>();
  #stopping = false;
  #polling: NodeJS.Timeout | undefined;

  constructor(options: DispatcherOptions) {
    this.#options = options;
    this.#log = options.logger.child({ component: 'dispatcher' });
  }

  /** These requests ended (gateway_requests_finished): a call of one still in flight here is aborted. */
  ended(ids: Iterable<string>): void {
    for (const id of ids) this.#calls.get(id)?.controller.abort(ABORTED_AS_ENDED);
  }

  /**
   * Whether the requests' ends can be heard (the LISTEN connection is up). While they cannot,
   * the calls' requests are checked every second; once they can again, once more, for the ends
   * announced while nobody listened.
   */
  hearing(listening: boolean): void {
    clearInterval(this.#polling);
    this.#polling = undefined;
    if (!listening) {
      this.#polling = setInterval(() => this.#checkEnded(), ENDED_POLL_MS);
      this.#polling.unref();
    } else {
      this.#checkEnded();
    }
  }

  #checkEnded(): void {
    if (this.#calls.size === 0) return;
    findEnded(this.#options.db, [...this.#calls.keys()]).then(
      (ids) => this.ended(ids),
      (error: unknown) => this.#log.debug({ err: errorSummary(error) }, 'could not check whether the calls\' requests ended'),
    );
  }

  /** Calls in flight now, by mode. */
  inFlight(mode: KeyMode): number {
    return this.#inFlight[mode];
  }

  /**
   * Dispatches the lane: resolves once a dispatch begun after this call has ended (its attempts
   * started, or the lane found without room); rejects if its claim failed.
   */
  dispatch(laneId: string): Promise<void> {
    const lane = this.#lane(laneId);
    const ended = new Promise<void>((resolve, reject) => lane.waiters.push({ resolve, reject }));
    this.#run(lane);
    return ended;
  }

  /** Dispatches the lane without waiting for it (its failures are logged). */
  poke(laneId: string): void {
    const lane = this.#lane(laneId);
    lane.poked = true;
    this.#run(lane);
  }

  /**
   * Takes no more; lets calls in flight finish for SHUTDOWN_GRACE_MS, then aborts the rest
   * (worker_lost) and gives up recordings still waiting for the database.
   */
  async stop(): Promise<void> {
    this.#stopping = true;
    clearInterval(this.#polling);
    await Promise.all([...this.#lanes.values()].map((lane) => lane.loop));
    await landWithin(this.#options.graceMs, () => this.#calls.values(), ABORTED_BY_SHUTDOWN, () =>
      this.#options.attempts.abandonRecordings(),
    );
  }

  #lane(id: string): LaneSlot {
    let lane = this.#lanes.get(id);
    if (!lane) {
      lane = { id, route: undefined, loop: undefined, waiters: [], poked: false };
      this.#lanes.set(id, lane);
    }
    return lane;
  }

  #run(lane: LaneSlot): void {
    if (lane.loop) return;
    lane.loop = this.#loop(lane).finally(() => {
      lane.loop = undefined;
    });
  }

  async #loop(lane: LaneSlot): Promise<void> {
    while (lane.poked || lane.waiters.length > 0) {
      const waiters = lane.waiters;
      lane.waiters = [];
      lane.poked = false;
      try {
        await this.#dispatchOnce(lane);
        for (const waiter of waiters) waiter.resolve();
      } catch (error) {
        this.#log.error({ laneId: lane.id, err: errorSummary(error) }, 'lane dispatch failed');
        // The jobs behind these waiters fail, and graphile-worker runs them again later.
        for (const waiter of waiters) waiter.reject(error);
      }
    }
  }

  async #dispatchOnce(lane: LaneSlot): Promise<void> {
    const db = this.#options.db;
    if (this.#stopping) {
      // Whatever asked for this dispatch is answered by another worker.
      await this.#db(() => addDispatch(db, lane.id));
      return;
    }
    if (lane.route === undefined) lane.route = this.#routeOf(await this.#db(() => findLane(db, lane.id)));
    const { route } = lane;
    if (!route) return;
    const mode = route.target.mode;
    for (;;) {
      const room = this.#options.capacity[mode] - this.#inFlight[mode] - this.#reserved[mode];
      const waiting = this.#waitingForCapacity[mode];
      if (room <= 0) {
        if (!waiting.has(lane)) {
          waiting.add(lane);
          // Another worker with room may take the lane meanwhile.
          await this.#db(() => addDispatch(db, lane.id));
        }
        return;
      }
      waiting.delete(lane);
      const claim = await this.#claimAndStart(lane, route, Math.min(room, CLAIM_BATCH));
      // Done when nothing due is left, when the limits hold the rest back (a dispatch is
      // scheduled for when they allow more), or when only ending calls make room.
      if (!claim.waiting || claim.roomAt !== undefined || claim.started.length === 0) return;
    }
  }

  /** Claims up to `max` of the lane's waiting requests, with that much room reserved, and starts their calls. */
  async #claimAndStart(lane: LaneSlot, route: Route, max: number): Promise<LaneClaim> {
    const { mode } = route.target;
    let reserved = max;
    this.#reserved[mode] += reserved;
    try {
      const claim = await this.#db(() => claimLane(this.#options.db, lane.id, max, this.workerId, route.limits));
      this.#release(mode, reserved - claim.started.length);
      reserved = claim.started.length;
      for (const [index, started] of claim.started.entries()) {
        // A claim can start hundreds of calls: their outcomes and the other lanes get a turn.
        if (index > 0 && index % START_SLICE === 0) await new Promise((resolve) => setImmediate(resolve));
        this.#reserved[mode]--;
        reserved--;
        this.#fly(lane, route, started);
      }
      return claim;
    } finally {
      this.#release(mode, reserved);
    }
  }

  /** Gives back room reserved and not used: the lanes that were waiting for room are dispatched. */
  #release(mode: KeyMode, room: number): void {
    if (room <= 0) return;
    this.#reserved[mode] -= room;
    if (this.#stopping) return;
    for (const waiting of this.#waitingForCapacity[mode]) this.poke(waiting.id);
  }

  #fly(lane: LaneSlot, { target, limits }: Route, started: StartedAttempt): void {
    const controller = new AbortController();
    const timer = setTimeout(abortTimedOut, this.#options.upstreamTimeoutMs, controller);
    this.#inFlight[target.mode]++;
    const done = this.#options.attempts.run(target, started, controller.signal).finally(() => {
      clearTimeout(timer);
      this.#calls.delete(started.id);
      this.#inFlight[target.mode]--;
      if (this.#stopping) return;
      if (limits.maxConcurrent !== undefined) this.poke(lane.id);
      for (const waiting of this.#waitingForCapacity[target.mode]) this.poke(waiting.id);
    });
    this.#calls.set(started.id, { controller, done });
  }

  #routeOf(lane: Lane | undefined): Route | null {
    if (!lane) return null;
    if (lane.mode === 'test') {
      return { target: { mode: 'test', upstream: undefined, modelLabel: SIMULATOR }, limits: NO_LIMITS };
    }
    const upstream = this.#options.upstreams.find((candidate) => candidate.name === lane.upstream);
    if (!upstream) {
      // Its requests wait for a worker configured with that upstream.
      this.#log.error({ laneId: lane.id, upstream: lane.upstream }, 'a lane names an upstream this worker does not know (UPSTREAMS_FILE)');
      return null;
    }
    return { target: { mode: 'live', upstream, modelLabel: modelLabel(upstream, lane.model) }, limits: upstream.limits };
  }

  #db<T>(statement: () => Promise<T>): Promise<T> {
    return whileUnavailable(statement, {
      maxWaitMs: OUTAGE_PATIENCE_MS,
      log: { logger: this.#log, message: 'database unavailable; retrying' },
    });
  }
}

function abortTimedOut(controller: AbortController): void {
  controller.abort(ABORTED_BY_TIMEOUT);
}
