// How attempts start. A dispatch of a model's queue asks Postgres for as many of its
// waiting requests as the lanes of its deployments allow, the first deployment preferred, each
// lane within its health and limits and in its projects' turns (gateway.claim_queue, one
// statement), and starts their upstream calls here. A call in flight holds a socket, a timer and
// a few objects: no database connection and no graphile-worker slot, so a worker process keeps
// thousands in flight, up to MAX_IN_FLIGHT live and TEST_MAX_IN_FLIGHT test calls, each mode in
// capacity of its own. With more than one upstream, each keeps a reserve of the live capacity
// that the others' calls leave free: upstreams that take calls and never answer, however many,
// fill the rest until their timeouts, and the other upstreams' queues still find room
// (upstreamReserve).
//
// What dispatches a queue:
// - its dispatch_queue jobs (jobs.ts): added with accepted requests, with retries, when a lane
//   changes health, and by claim_queue itself for the time a lane waiting for its rate limits, a
//   pause or a probe has room again;
// - in a process that also serves the API, the requests it has just accepted (no queue hop);
// - a call on a lane with max_concurrent ending here: the room it leaves is taken by the process
//   that had it (a process waiting for that room elsewhere would never hear of it);
// - room made in this process's capacity, for the queues that were waiting for it;
// - the rescue (rescue.ts), for a queue with requests due that none of these is going to wake.
// A process that stops hands the last two to the other workers, a job due now for each queue.
// Dispatches of one queue in one process run one at a time: calls that arrive meanwhile share
// the next.
//
// The one other way: a wait=true request that a process accepts may be stored with its first
// attempt started, when a claim would start it and nothing else (reserveStart, and
// requests/insert-repository.ts): its call then starts here without a claim.
//
// Models are the clients' to name (an upstream's pattern serves them), so what this process keeps
// per queue is bounded: a queue's slot lives while a dispatch of it is under way or asked for, or
// while it waits for capacity here; its route (mode, model, lanes), read from the database on its
// first dispatch, is remembered for the QUEUE_ROUTES_REMEMBERED queues dispatched most recently.
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
import { LRUCache } from 'lru-cache';
import type { Config } from '../config.ts';
import { errorSummary, type Db } from '../db/pool.ts';
import { abortAfter, ABORTED_AS_ENDED, landWithin, type InFlight } from '../grace.ts';
import { whileUnavailable } from '../db/retry.ts';
import type { KeyMode } from '../ids.ts';
import {
  addDispatch,
  claimQueue,
  ensureLanes,
  findQueue,
  type DeploymentLane,
  type Queue,
  type QueueClaim,
  type StartedAttempt,
  type StartReservation,
} from '../lanes/repository.ts';
import { findEnded, RETRY_SLOT_MS } from './attempts-repository.ts';
import { deploymentsOf, hasNoLimits, modelLabel, NO_LIMITS, SIMULATOR, upstreamModel, type Upstream } from '../upstream/upstreams.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { reportLaneChange } from './lane-changes.ts';
import type { Attempts, CallTarget } from './attempts.ts';

export interface DispatcherOptions {
  db: Db;
  attempts: Attempts;
  upstreams: readonly Upstream[];
  /** Calls in flight at most, per mode (MAX_IN_FLIGHT, TEST_MAX_IN_FLIGHT). */
  capacity: Readonly<Record<KeyMode, number>>;
  /** Routes of queues remembered at most (QUEUE_ROUTES_REMEMBERED unless given). */
  routesRemembered?: number;
  upstreamTimeoutMs: number;
  /** How long calls in flight may finish at shutdown (SHUTDOWN_GRACE_MS). */
  graceMs: number;
  metrics: Metrics;
  logger: Logger;
}

/** The dispatcher's options that the settings decide. */
export function dispatcherSettings(
  config: Pick<Config, 'upstreams' | 'maxInFlight' | 'testMaxInFlight' | 'upstreamTimeoutMs' | 'shutdownGraceMs'>,
): Pick<DispatcherOptions, 'upstreams' | 'capacity' | 'upstreamTimeoutMs' | 'graceMs'> {
  return {
    upstreams: config.upstreams,
    capacity: { live: config.maxInFlight, test: config.testMaxInFlight },
    upstreamTimeoutMs: config.upstreamTimeoutMs,
    graceMs: config.shutdownGraceMs,
  };
}

// Attempts started by one claim statement at most, and started before the event loop is given a turn.
const CLAIM_BATCH = 500;
const START_SLICE = 50;
// How long a statement is retried while the database is unreachable.
const OUTAGE_PATIENCE_MS = 60_000;
// How often the calls' requests are checked while their ends cannot be heard.
const ENDED_POLL_MS = 1_000;
/**
 * How long the dispatch job of a request accepted by a process that dispatches it itself waits
 * before it is due. The process claims the request at once (onStored); the job is there for when
 * the process dies between the commit and the claim. Due later, it is fetched long after its
 * request's claim, and its dispatch finds nothing to do, instead of being fetched and recorded
 * (two commits, each waiting for its flush) beside the request's own claim.
 */
export const OWN_DISPATCH_FALLBACK_MS = 2_000;
/** Routes of queues remembered at most (the least recently dispatched are read again when next needed). */
export const QUEUE_ROUTES_REMEMBERED = 10_000;
/**
 * The share of a process's live capacity that one upstream may take when the process has
 * several and the others have no calls: the rest is the others' reserves (upstreamReserve).
 */
export const UPSTREAM_SHARE = 0.9;

/**
 * The live calls kept within reach of each upstream of a process (its reserve): none with a
 * single upstream, else the capacity beyond UPSTREAM_SHARE split between all upstreams but one
 * (one call each at least, and no more than an even split of the whole capacity). An upstream's
 * calls (in flight, and room its claims are starting) count toward its reserve, and what it
 * lacks of it is kept free: the calls of any one upstream take only the room the others' reserves
 * leave. So an upstream alone takes all of the capacity but the others' reserves (UPSTREAM_SHARE
 * of it), and upstreams that take calls and never answer, however many of them, leave every other
 * upstream its reserve until their calls time out.
 */
export function upstreamReserve(capacity: number, upstreams: number): number {
  if (upstreams <= 1) return 0;
  const beyondShare = capacity - Math.floor(capacity * UPSTREAM_SHARE);
  return Math.min(Math.floor(capacity / upstreams), Math.max(1, Math.floor(beyondShare / (upstreams - 1))));
}

/** A lane of a queue's deployments: where its calls go, and its limits. */
interface Deployment extends DeploymentLane {
  target: CallTarget;
}

/** A queue's mode and deployments, in the order they are preferred (none: no upstream here serves its model). */
interface Route {
  mode: KeyMode;
  model: string;
  deployments: readonly Deployment[];
  /** The deployments by lane id. */
  lanes: ReadonlyMap<string, Deployment>;
  /** The names of the upstreams of its deployments, each once (none in test mode). */
  upstreams: readonly string[];
}

interface QueueSlot {
  readonly id: string;
  /** Read on the slot's first dispatch unless remembered (null: the queue does not exist). */
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
  /** Slots of the queues with a dispatch under way or asked for, or waiting for capacity. */
  readonly #queues = new Map<string, QueueSlot>();
  /** Routes of the queues dispatched most recently, by queue id. */
  readonly #routes: LRUCache<string, Route>;
  /** Queues whose last dispatch stopped for this process's capacity, by mode. */
  readonly #waitingForCapacity: Record<KeyMode, Set<QueueSlot>> = { live: new Set(), test: new Set() };
  readonly #inFlight: Record<KeyMode, number> = { live: 0, test: 0 };
  /** Live calls kept within reach of each upstream here (upstreamReserve). */
  readonly #upstreamReserve: number;
  /**
   * Live calls in flight and room reserved for claims, by upstream name. A claim reserves its
   * room on the upstream of its queue's deployments whose reserve it may take (#room), and keeps
   * it for the calls it started, on theirs, until they end.
   */
  readonly #upstreamHeld = new Map<string, number>();
  /** What the upstreams lack of their reserves, all together: the live room kept free for them. */
  #upstreamShortfall: number;
  /**
   * Room promised to claims under way, by mode: from before a claim until each call it started
   * is in flight. Dispatches of several queues run at once; without this, each would count the
   * same room free, and together start more calls than the capacity.
   */
  readonly #reserved: Record<KeyMode, number> = { live: 0, test: 0 };
  /**
   * Calls in flight, by request id. A request may have two here: a call of its attempt that
   * another worker's sweep recorded as worker_lost (this process's heartbeat came late) is still
   * under way when this process claims the next attempt.
   */
  readonly #calls = new Map<string, Set<InFlight>>();
  #stopping = false;
  #polling: NodeJS.Timeout | undefined;
  /** Checks of the calls' requests under way (#checkEnded), awaited by stop(). */
  readonly #checks = new Set<Promise<void>>();
  /**
   * Queues this process dispatches again when time gives one of their lanes room (their claims
   * said when) or a retry it recorded comes due: a timer by queue and slot (wakeIn). A dispatch
   * job due then was added too, for whichever worker fetches it; that fetch comes on a worker's
   * next poll for jobs after it is due (its notification came when it was added), up to
   * WORKER_POLL_INTERVAL_MS late: a lane paced by its limits would lose that much of its room
   * each time it ran out, and a retry would wait that much longer than its backoff.
   */
  readonly #wakes = new Map<string, NodeJS.Timeout>();
  /**
   * Dispatches asked of the other workers while this one stops (#handOver), awaited by stop():
   * the wake-ups this process would have given itself.
   */
  readonly #handingOver = new Set<Promise<void>>();

  constructor(options: DispatcherOptions) {
    this.#options = options;
    this.#log = options.logger.child({ component: 'dispatcher' });
    this.#routes = new LRUCache({ max: options.routesRemembered ?? QUEUE_ROUTES_REMEMBERED });
    const upstreams = new Set(options.upstreams.map((upstream) => upstream.name)).size;
    this.#upstreamReserve = upstreamReserve(options.capacity.live, upstreams);
    this.#upstreamShortfall = upstreams * this.#upstreamReserve;
  }

  /** What this process keeps per queue: slots (dispatches under way or waiting) and routes remembered. */
  get remembered(): { slots: number; routes: number } {
    return { slots: this.#queues.size, routes: this.#routes.size };
  }

  /** These queues were deleted (pruned): their routes are forgotten. */
  forgetQueues(ids: Iterable<string>): void {
    for (const id of ids) this.#routes.delete(id);
  }

  /** These requests ended (gateway_requests_finished): their calls still in flight here are aborted. */
  ended(ids: Iterable<string>): void {
    for (const id of ids) for (const call of this.#calls.get(id) ?? []) call.controller.abort(ABORTED_AS_ENDED);
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
    const check: Promise<void> = findEnded(this.#options.db, [...this.#calls.keys()])
      .then(
        (ids) => this.ended(ids),
        (error: unknown) => this.#log.debug({ err: errorSummary(error) }, 'could not check whether the calls\' requests ended'),
      )
      .finally(() => this.#checks.delete(check));
    this.#checks.add(check);
  }

  /** Calls in flight now, by mode. */
  inFlight(mode: KeyMode): number {
    return this.#inFlight[mode];
  }

  /**
   * Dispatches the queue: resolves once a dispatch begun after this call has ended (its attempts
   * started, or its lanes found without room); rejects if its claim failed.
   */
  dispatch(queueId: string): Promise<void> {
    const queue = this.#queue(queueId);
    const ended = new Promise<void>((resolve, reject) => queue.waiters.push({ resolve, reject }));
    this.#run(queue);
    return ended;
  }

  /**
   * Room for one call, reserved for a request of the queue that this process is about to accept
   * and may start in the accept's own statement, with no claim after it (requests/insert-repository.ts
   * says when it does). Only where a claim would do nothing more than start it: the queue's route
   * is known here, its preferred deployment has no limits (each of which only a claim keeps), and
   * this process has room, on that deployment's upstream too. undefined otherwise: the request is
   * accepted as queued, and dispatched.
   */
  reserveStart(queueId: string): StartReservation | undefined {
    if (this.#stopping) return undefined;
    const route = this.#routes.get(queueId);
    const deployment = route?.deployments[0];
    if (!route || !deployment || !hasNoLimits(deployment.limits)) return undefined;
    const { mode } = route;
    const upstream = deployment.target.upstream?.name;
    if (this.#room(mode, upstream === undefined ? [] : [upstream]) <= 0) return undefined;
    this.#reserved[mode]++;
    this.#hold(upstream, 1);
    let held = true;
    return {
      laneId: deployment.laneId,
      workerId: this.workerId,
      start: (requestId, body) => {
        if (!held) return;
        held = false;
        this.#reserved[mode]--;
        if (this.#stopping) {
          // Stored as the worker stopped: no call starts now (none could be recorded after the
          // stop), and its attempt is recovered as worker_lost once this worker is gone.
          this.#log.warn({ requestId }, 'request accepted while the worker stopped: its attempt is left to the supervisor');
          this.#hold(upstream, -1);
          return;
        }
        this.#fly(queueId, deployment, { id: requestId, attempt: 1, probe: false, charged: 0, laneId: deployment.laneId, body });
      },
      release: () => {
        if (!held) return;
        held = false;
        this.#hold(upstream, -1);
        this.#release(mode, 1);
      },
    };
  }

  /** Dispatches the queue without waiting for it (its failures are logged). */
  poke(queueId: string): void {
    const queue = this.#queue(queueId);
    queue.poked = true;
    this.#run(queue);
  }

  /**
   * Takes no more; lets calls in flight finish for SHUTDOWN_GRACE_MS, then aborts the rest
   * (worker_lost) and gives up recordings still waiting for the database.
   */
  async stop(): Promise<void> {
    this.#stopping = true;
    clearInterval(this.#polling);
    for (const timer of this.#wakes.values()) clearTimeout(timer);
    this.#wakes.clear();
    // The queues waiting for room here would have been dispatched here as calls ended: other
    // workers may have room now.
    for (const waiting of [...this.#waitingForCapacity.live, ...this.#waitingForCapacity.test]) this.#handOver(waiting.id);
    await Promise.all([...this.#queues.values()].map((queue) => queue.loop));
    await landWithin(this.#options.graceMs, () => [...this.#calls.values()].flatMap((calls) => [...calls]), () => this.#options.attempts.abandonRecordings());
    await Promise.all(this.#checks);
    await Promise.all(this.#handingOver);
  }

  /**
   * A dispatch of the queue for another worker to run: a job due now. Tried once, not through an
   * outage (the stop would wait for it): if it fails, the rescue (rescue.ts) finds the queue.
   */
  #handOver(queueId: string): void {
    const handed: Promise<void> = addDispatch(this.#options.db, queueId)
      .catch((error: unknown) =>
        this.#log.warn({ queueId, err: errorSummary(error) }, 'could not hand a queue over to the other workers; the rescue will dispatch it'),
      )
      .finally(() => this.#handingOver.delete(handed));
    this.#handingOver.add(handed);
  }

  #queue(id: string): QueueSlot {
    let queue = this.#queues.get(id);
    if (!queue) {
      queue = { id, route: this.#routes.get(id), loop: undefined, waiters: [], poked: false };
      this.#queues.set(id, queue);
    }
    return queue;
  }

  #run(queue: QueueSlot): void {
    if (queue.loop) return;
    queue.loop = this.#loop(queue).finally(() => {
      queue.loop = undefined;
      // Asked for between the loop's last look and now: it runs again.
      if (queue.poked || queue.waiters.length > 0) {
        this.#run(queue);
      } else if (!this.#waitingForCapacity.live.has(queue) && !this.#waitingForCapacity.test.has(queue)) {
        this.#queues.delete(queue.id);
      }
    });
  }

  async #loop(queue: QueueSlot): Promise<void> {
    while (queue.poked || queue.waiters.length > 0) {
      const waiters = queue.waiters;
      queue.waiters = [];
      queue.poked = false;
      try {
        await this.#dispatchOnce(queue);
        for (const waiter of waiters) waiter.resolve();
      } catch (error) {
        this.#log.error({ queueId: queue.id, err: errorSummary(error) }, 'queue dispatch failed');
        // The jobs behind these waiters fail, and graphile-worker runs them again later.
        for (const waiter of waiters) waiter.reject(error);
      }
    }
  }

  async #dispatchOnce(queue: QueueSlot): Promise<void> {
    const db = this.#options.db;
    if (this.#stopping) {
      // Whatever asked for this dispatch is answered by another worker.
      await this.#db(() => addDispatch(db, queue.id));
      return;
    }
    if (queue.route === undefined) {
      const found = await this.#db(() => findQueue(db, queue.id));
      queue.route = found ? await this.#db(() => this.#routeOf(found)) : null;
      if (queue.route) this.#routes.set(queue.id, queue.route);
    }
    const { route } = queue;
    if (!route) return;
    const { mode } = route;
    for (;;) {
      const room = this.#room(mode, route.upstreams);
      const waiting = this.#waitingForCapacity[mode];
      if (room <= 0) {
        if (!waiting.has(queue)) {
          waiting.add(queue);
          // Another worker with room may take the queue meanwhile.
          await this.#db(() => addDispatch(db, queue.id));
        }
        return;
      }
      waiting.delete(queue);
      const claim = await this.#claimAndStart(queue, route, Math.min(room, CLAIM_BATCH));
      // Done when nothing due is left, when time holds the rest back (a dispatch is scheduled
      // for when a lane has room), or when only ending calls make room.
      if (claim.roomInMs !== undefined) this.wakeIn(queue.id, claim.roomInMs);
      if (!claim.waiting || claim.roomInMs !== undefined || claim.started.length === 0) return;
    }
  }

  /** Claims up to `max` of the queue's waiting requests, with that much room reserved, and starts their calls. */
  async #claimAndStart(queue: QueueSlot, route: Route, max: number): Promise<QueueClaim> {
    const { mode } = route;
    let reserved = max;
    this.#reserved[mode] += reserved;
    const holding = this.#leastLacking(route.upstreams);
    this.#hold(holding, max);
    // The calls started and not yet in flight, each holding room on its upstream.
    let pending: StartedAttempt[] | undefined;
    try {
      const claim = await this.#db(() => claimQueue(this.#options.db, queue.id, max, this.workerId, route.deployments));
      pending = claim.started;
      for (const reopened of claim.reopened) this.#probeLost(route.lanes.get(reopened.laneId), route.model, reopened.lastError);
      for (const started of claim.started) this.#hold(route.lanes.get(started.laneId)!.target.upstream?.name, 1);
      this.#hold(holding, -max);
      this.#release(mode, reserved - claim.started.length, route.upstreams.length > 1);
      reserved = claim.started.length;
      for (const [index, started] of claim.started.entries()) {
        // A claim can start hundreds of calls: their outcomes and the other queues get a turn.
        if (index > 0 && index % START_SLICE === 0) await new Promise((resolve) => setImmediate(resolve));
        this.#reserved[mode]--;
        reserved--;
        const deployment = route.lanes.get(started.laneId)!;
        if (started.probe) this.#probing(deployment, route.model, started);
        this.#fly(queue.id, deployment, started);
      }
      return claim;
    } finally {
      if (pending === undefined) {
        this.#hold(holding, -max);
      } else {
        for (const started of pending.slice(pending.length - reserved)) this.#hold(route.lanes.get(started.laneId)!.target.upstream?.name, -1);
      }
      this.#release(mode, reserved);
    }
  }

  /**
   * Room for calls of a queue of this mode whose deployments are on these upstreams: the
   * process's, less the live room kept for the upstreams' reserves (upstreamReserve), but the
   * reserve of the queue's own upstream, or of the one of its upstreams lacking least of it when
   * it has several (#leastLacking): its claim may start all its calls on any one of them, and
   * wherever they start, they fill that much of their upstream's reserve. The claim holds its room
   * on that upstream until its calls start (a claim of another queue on it does not take the same
   * reserve twice). Two claims at once may still fill one reserve twice, when their queues share
   * an upstream and one of them started its calls on an upstream whose reserve it did not hold:
   * a reserve is short by that much until those calls end.
   */
  #room(mode: KeyMode, upstreams: readonly string[]): number {
    const room = this.#options.capacity[mode] - this.#inFlight[mode] - this.#reserved[mode];
    if (mode !== 'live') return room;
    const own = this.#leastLacking(upstreams);
    return room - this.#upstreamShortfall + (own === undefined ? 0 : this.#lacking(own));
  }

  /** What the upstream lacks of its reserve. */
  #lacking(upstream: string): number {
    return this.#lack(this.#upstreamHeld.get(upstream) ?? 0);
  }

  /** What an upstream holding `held` calls lacks of its reserve. */
  #lack(held: number): number {
    return Math.max(0, this.#upstreamReserve - held);
  }

  /** Of these upstreams, the one lacking least of its reserve (the first of those when several do); none of none. */
  #leastLacking(upstreams: readonly string[]): string | undefined {
    let least: string | undefined;
    for (const upstream of upstreams) if (least === undefined || this.#lacking(upstream) < this.#lacking(least)) least = upstream;
    return least;
  }

  /** Counts `count` more calls (or room reserved) held on the upstream (none for the simulator). */
  #hold(upstream: string | undefined, count: number): void {
    if (upstream === undefined || count === 0) return;
    const before = this.#upstreamHeld.get(upstream) ?? 0;
    const held = before + count;
    this.#upstreamShortfall += this.#lack(held) - this.#lack(before);
    if (held === 0) this.#upstreamHeld.delete(upstream);
    else this.#upstreamHeld.set(upstream, held);
  }

  /**
   * Dispatches the queue when `ms` have passed: at once when none is left (a retry due now), else
   * at the end of its slot of RETRY_SLOT_MS, one timer per queue and slot however many retries
   * and claims ask for it.
   */
  wakeIn(queueId: string, ms: number): void {
    if (this.#stopping) return;
    if (ms <= 0) {
      this.poke(queueId);
      return;
    }
    const slot = Math.ceil((Date.now() + Math.max(0, ms)) / RETRY_SLOT_MS);
    const key = `${queueId}:${slot}`;
    if (this.#wakes.has(key)) return;
    const timer = setTimeout(() => {
      this.#wakes.delete(key);
      this.poke(queueId);
    }, slot * RETRY_SLOT_MS - Date.now());
    // Nothing to keep a process alive for: a process that stops without stop() leaves the jobs.
    timer.unref();
    this.#wakes.set(key, timer);
  }

  /**
   * Gives back room reserved and not used: the queues that were waiting for room are dispatched,
   * also when only room on upstreams was given back (`upstreamRoom`).
   */
  #release(mode: KeyMode, room: number, upstreamRoom = false): void {
    if (room <= 0 && !upstreamRoom) return;
    this.#reserved[mode] -= Math.max(0, room);
    if (this.#stopping) return;
    for (const waiting of this.#waitingForCapacity[mode]) this.poke(waiting.id);
  }

  #fly(queueId: string, { target, limits }: Deployment, started: StartedAttempt): void {
    const controller = new AbortController();
    const stopTimeout = abortAfter(controller, this.#options.upstreamTimeoutMs);
    this.#inFlight[target.mode]++;
    const running = this.#options.attempts.run(target, started, controller.signal);
    // A retry it recorded: its queue is dispatched here when it is due (the dispatch job added
    // for it is due then too, for whichever worker fetches it on its next poll).
    void running.then((retryInMs) => retryInMs !== undefined && this.wakeIn(queueId, retryInMs), () => {});
    const done = running.finally(() => {
      stopTimeout();
      calls.delete(call);
      if (calls.size === 0) this.#calls.delete(started.id);
      this.#inFlight[target.mode]--;
      this.#hold(target.upstream?.name, -1);
      if (this.#stopping) {
        // The room it leaves on its lane is for another worker to take.
        if (limits.maxConcurrent !== undefined) this.#handOver(queueId);
        return;
      }
      if (limits.maxConcurrent !== undefined) this.poke(queueId);
      for (const waiting of this.#waitingForCapacity[target.mode]) this.poke(waiting.id);
    });
    const call: InFlight = { controller, done };
    const calls = this.#calls.get(started.id) ?? new Set();
    calls.add(call);
    this.#calls.set(started.id, calls);
  }

  /** An open lane's probe starts: the lane is probing. */
  #probing({ laneId, target }: Deployment, model: string, started: StartedAttempt): void {
    const upstream = target.upstream?.name ?? SIMULATOR;
    reportLaneChange({ metrics: this.#options.metrics, log: this.#log }, { laneId, upstream, model, from: 'open', to: 'probing', lastError: null });
    this.#log.debug({ laneId, requestId: started.id, attempt: started.attempt }, 'probe started');
  }

  /** A probe ended without a word (its request cancelled, failed for its deadline, or its worker lost): the claim opened its lane again. */
  #probeLost(deployment: Deployment | undefined, model: string, lastError: string | null): void {
    if (!deployment) return;
    const upstream = deployment.target.upstream?.name ?? SIMULATOR;
    reportLaneChange({ metrics: this.#options.metrics, log: this.#log }, { laneId: deployment.laneId, upstream, model, from: 'probing', to: 'open', lastError });
  }

  /** The queue's deployments as this worker is configured: their lanes, created on first use. */
  async #routeOf(queue: Queue): Promise<Route> {
    const upstreams: (Upstream | undefined)[] = queue.mode === 'test' ? [undefined] : deploymentsOf(this.#options.upstreams, queue.model);
    if (upstreams.length === 0) {
      // Its requests wait for a worker configured with an upstream that serves the model, or their deadline.
      this.#log.error({ queueId: queue.id, model: queue.model }, 'no upstream this worker knows serves a model with requests waiting (UPSTREAMS_FILE)');
    }
    const laneIds = await ensureLanes(this.#options.db, queue, upstreams.map((upstream) => upstream?.name ?? SIMULATOR));
    const deployments = upstreams.map((upstream, index): Deployment => {
      const target: CallTarget =
        upstream === undefined
          ? { mode: 'test', upstream: undefined, model: undefined, modelLabel: SIMULATOR }
          : { mode: 'live', upstream, model: renamedFor(upstream, queue.model), modelLabel: modelLabel(upstream, queue.model) };
      return { laneId: laneIds[index]!, target, limits: upstream?.limits ?? NO_LIMITS };
    });
    return {
      mode: queue.mode,
      model: queue.model,
      deployments,
      lanes: new Map(deployments.map((deployment) => [deployment.laneId, deployment])),
      upstreams: [...new Set(upstreams.flatMap((upstream) => (upstream === undefined ? [] : [upstream.name])))],
    };
  }

  #db<T>(statement: () => Promise<T>): Promise<T> {
    return whileUnavailable(statement, {
      maxWaitMs: OUTAGE_PATIENCE_MS,
      log: { logger: this.#log, message: 'database unavailable; retrying' },
    });
  }
}

/** The upstream's own name for the model when the file renames it; undefined when the body is sent as stored. */
function renamedFor(upstream: Upstream, model: string): string | undefined {
  const own = upstreamModel(upstream, model);
  return own === model ? undefined : own;
}

