// Delivering webhook messages (docs/webhooks.md), one try at a time. A deliver_webhook job
// claims its message in one statement and starts the try here, then ends: a try in flight holds
// a socket and a timer, not a graphile-worker slot nor a database connection, as upstream calls
// do (worker/dispatcher.ts). The try POSTs the event, signed as Standard Webhooks says, and its
// end is recorded in one statement: delivered on a 2xx; a 410 disables the endpoint; anything
// else, or no complete answer within WEBHOOK_TIMEOUT_MS, is retried after the next wait of
// WEBHOOK_RETRY_SCHEDULE, until the schedule is spent. A 429 or 503's retry-after delays that
// retry, and pauses the endpoint for every worker: none of its messages is claimed before then.
//
// One endpoint cannot take the room of the others:
// - a process has up to WEBHOOK_MAX_IN_FLIGHT tries in flight, and up to
//   WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT of them to one endpoint (counted here, per process);
// - an endpoint that leaves a try unanswered until the timeout backs off, for every worker (its
//   row: sql/000014.sql): no try starts on it for ENDPOINT_BACKOFF.minMs, then one at a time (a
//   probe), the wait doubling after each probe left unanswered; any other end of a try ends it.
// A message that finds no room or its endpoint backing off (or paused by a retry-after) is not
// claimed, so it keeps its tries (its retry schedule is untouched): it waits, pending and due,
// and its job ends. Its endpoint's one wake_webhook_endpoint job (scheduleWake) then claims the
// endpoint's waiting messages, oldest first, as room allows, and is added again while some still
// wait: when the backoff's wait (or the pause) ends, or after a wait doubling each time it finds
// no room (wakeDelay); being a job, it outlives the
// worker that added it. Room made here is taken at once: a try ending here claims its endpoint's
// waiting messages, then those of endpoints that waited for this process's room (#pull).
//
// Tries are owned by the process's worker id (the dispatcher's, kept alive by the supervisor's
// heartbeat). If the process dies, its messages stay delivering until the supervisor's sweep
// finds that id gone and hands them back (recoverLost); at shutdown, tries in flight get
// SHUTDOWN_GRACE_MS, then are aborted and retried at once. A try's end is recorded however long
// the database stays unavailable, until the shutdown's grace is over: given up, its message
// would be handed back by the sweep and delivered again. While the process lives, no sweep takes
// its tries, so it hands back itself the ones it has lost track of (recoverForgotten): a claim
// committed whose answer never came (the connection dropped on its way: run again, the claim
// finds the message delivering, not pending), or a try whose end could not be recorded.
import { Agent, request } from 'undici';
import { doubling, jitter } from '../client/backoff.ts';
import { parseRetryAfter } from '../client/retry.ts';
import { signWebhook } from '../client/webhooks.ts';
import type { Config } from '../config.ts';
import { errorSummary, isDatabaseUnavailable, type Db } from '../db/pool.ts';
import { CONFLICT_RETRIES, whileUnavailable } from '../db/retry.ts';
import { abortAfter, ABORTED_BY_SHUTDOWN, ABORTED_BY_TIMEOUT, landWithin, type InFlight } from '../grace.ts';
import { decryptSecret } from '../keys/secrets.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { connectionFailure, findCause } from '../network-errors.ts';
import { recordJson } from '../requests/record.ts';
import { deliveryConnector, ForbiddenAddressError, isAllowedScheme } from './address.ts';
import {
  addDeliveryJob,
  claimDue,
  claimMessage,
  findMessageEndpoint,
  finishTry,
  recoverForgottenDeliveries,
  recoverLostDeliveries,
  scheduleWake,
  type Claim,
  type ClaimedMessage,
  type DueClaim,
  type EndpointBackoff,
  type TryEnd,
} from './delivery-repository.ts';

export interface WebhookDelivererOptions {
  db: Db;
  /** secretEncryptionKeys: every key that may decrypt the endpoints' secrets (empty: none set, nothing is sent). */
  config: Pick<Config, 'webhooks' | 'secretEncryptionKeys' | 'shutdownGraceMs'>;
  /** The owner of this process's tries (webhook_messages.worker_id): the dispatcher's workerId. */
  workerId: string;
  metrics: Metrics;
  logger: Logger;
}

/** What deliver() did with a message, or wake() with an endpoint's. */
export type Delivery =
  /** A try is under way (wake: at least one). */
  | 'started'
  /** Its endpoint is disabled: the message is abandoned. */
  | 'abandoned'
  /** Nothing to do: not pending or not due (delivered, given up, under way elsewhere, removed). */
  | 'nothing'
  /**
   * No try now. No room, or the endpoint backs off: the message waits for its endpoint's wake.
   * Shutting down, or no SECRET_ENCRYPTION_KEY: its job is added again for later.
   */
  | 'deferred';

/** Why a due message was not tried (gateway_webhook_deferrals_total). */
type DeferralReason = 'endpoint_busy' | 'worker_busy' | 'endpoint_backing_off';

/** The longest wait before a retry, whatever the schedule or a retry-after says. */
export const MAX_RETRY_WAIT_MS = 24 * 60 * 60 * 1000;
/** The waits of an endpoint that backs off: 1 s after its first time-out, doubled after each probe left unanswered. */
export const ENDPOINT_BACKOFF: EndpointBackoff = { minMs: 1_000, maxMs: 60_000 };
// A probe keeps the other tries off its endpoint for WEBHOOK_TIMEOUT_MS and this much more: the
// time to record its end, which starts the next wait.
const PROBE_MARGIN_MS = 1_000;
// Without SECRET_ENCRYPTION_KEY nothing can be signed: messages are looked at again this often.
const NO_KEY_RETRY_MS = 60_000;
// A message whose endpoint's secret none of this worker's keys decrypts is made again after a
// wait from NO_KEY_RETRY_MS, doubled each time it was not sent for a fault of ours, up to this;
// once it is older than the retry schedule's span (retryScheduleSpan), it is given up instead.
const SECRET_UNDECRYPTABLE_MAX_RETRY_MS = 60 * 60_000;
// What of a receiver's answer is read (and dropped), so that its connection serves the next try.
const MAX_ANSWER_BYTES = 64 * 1024;
// Idle connections to an endpoint kept for its next tries this long.
const KEEP_ALIVE_MS = 10_000;
// How long a statement other than a try's end is retried while the database is unavailable
// (the job fails then, and graphile-worker runs it again later).
const OUTAGE_PATIENCE_MS = 60_000;
// How often this process looks for the tries it has lost track of (recoverForgotten).
const FORGOTTEN_CHECK_MS = 10_000;
// A message delivering under this process's id, with no try of it in flight here, is taken for
// lost track of once its try started (its claim's transaction did) more than WEBHOOK_TIMEOUT_MS
// and this much ago. The margin leaves alone a claim whose answer is still on its way: a claim
// runs 30 s at most (statement_timeout, db/pool.ts), and its answer takes far less to arrive.
// Past WEBHOOK_TIMEOUT_MS, few tries in flight are as old (those whose end waits for the
// database), and only those are compared with the tries in flight.
const FORGOTTEN_AFTER_MS = 60_000;
// Tries handed back per look at most; the next look takes the rest.
const FORGOTTEN_BATCH = 1_000;

/**
 * How long an endpoint's wake job waits before looking at messages that found no room, the
 * `deferrals`-th time in a row that there was none: 1 s, doubled each time, up to a minute. (A
 * try ending in a process that has the room looks at once.)
 */
export function wakeDelay(deferrals: number): number {
  return doubling(deferrals + 1, 1_000, 60_000);
}

/**
 * The wait before the try that follows a message's failure number `failures` (its tries that
 * failed, not counting those their worker lost): that entry of the schedule, ±10 % jitter, never
 * shorter than a retry-after the endpoint sent, at most 24 h; undefined once the schedule is spent.
 */
export function nextTryDelay(
  scheduleMs: readonly number[],
  failures: number,
  retryAfterMs?: number,
  random: () => number = Math.random,
): number | undefined {
  const wait = scheduleMs[failures - 1];
  if (wait === undefined) return undefined;
  return Math.round(Math.min(MAX_RETRY_WAIT_MS, Math.max(jitter(wait, 0.1, 0.1, random), retryAfterMs ?? 0)));
}

/**
 * How long the retry schedule lasts: the sum of its waits (each at most MAX_RETRY_WAIT_MS). An
 * event that no worker could sign for this long is given up: a key rotation has had the time to
 * reach every worker, and the event ends by its schedule, as one that its endpoint failed does.
 */
export function retryScheduleSpan(scheduleMs: readonly number[]): number {
  return scheduleMs.reduce((sum, wait) => sum + Math.min(wait, MAX_RETRY_WAIT_MS), 0);
}

/** The body of a delivery: the event, when its request ended, and the request's record. */
export function eventBody(message: Pick<ClaimedMessage, 'event_type' | 'created_at' | 'request'>): string {
  const head = JSON.stringify({ type: message.event_type, timestamp: message.created_at.toISOString() });
  return `${head.slice(0, -1)},"data":${recordJson(message.request)}}`;
}

/** How a try went, before it is recorded. */
type Answer =
  | { kind: 'delivered'; httpStatus: number }
  | { kind: 'gone'; httpStatus: number }
  | {
      kind: 'failed';
      httpStatus: number | null;
      error: string;
      retryAfterMs?: number | undefined;
      /** A 429 or 503: its retry-after, if any, holds back the endpoint's other messages too. */
      pausesEndpoint?: boolean;
      /**
       * A failure of ours, not the endpoint's (our shutdown cut the try short, or we could not
       * sign it): it spends no retry, and the try is made again in retryInMs, or never
       * (undefined: the event is given up).
       */
      ours?: { retryInMs: number | undefined };
      /** What it says of the endpoint (TryEnd.timedOut): undefined when the failure was ours. */
      timedOut: boolean | undefined;
    };

/** A try in flight, and its message. */
interface Try extends InFlight {
  readonly messageId: string;
}

/** What this process knows of an endpoint it delivers to. */
interface EndpointSlot {
  readonly id: string;
  /** Its tries in flight here, and the room that claims under way hold for it. */
  busy: number;
  /** Some of its messages wait, due, for room here: room made here is offered to it (#pull). */
  waiting: boolean;
  /** The claims of its waiting messages under way; `again`: room was made meanwhile. */
  pulling: Promise<void> | undefined;
  again: boolean;
}

export class WebhookDeliverer {
  readonly workerId: string;
  readonly #options: WebhookDelivererOptions;
  readonly #log: Logger;
  readonly #agent: Agent;
  /** Tries in flight: each one's abort controller, the promise of its end, and its message. */
  readonly #tries = new Map<AbortController, Try>();
  /** The endpoints with tries in flight here, claims under way, or messages waiting for room here. */
  readonly #endpoints = new Map<string, EndpointSlot>();
  /** Those whose messages wait for room here, in the order they began to wait. */
  readonly #waiting = new Set<EndpointSlot>();
  /** Room held by claims under way, all endpoints together (counted against WEBHOOK_MAX_IN_FLIGHT). */
  #held = 0;
  /** Claims under way (each may start tries): awaited by stop(). */
  readonly #claims = new Set<Promise<unknown>>();
  #stopping = false;
  /** Aborted once the shutdown's grace is over: tries' ends still unrecorded are given up. */
  readonly #abandoning = new AbortController();
  #stopped: Promise<void> | undefined;
  #toldNoKey = false;
  /** Looks for the tries this process lost track of, every FORGOTTEN_CHECK_MS until stop(). */
  readonly #forgottenTimer: NodeJS.Timeout;
  /** The look under way, if any: awaited by stop(). */
  #lookingForForgotten: Promise<void> | undefined;

  constructor(options: WebhookDelivererOptions) {
    this.#options = options;
    this.workerId = options.workerId;
    this.#log = options.logger.child({ component: 'webhooks' });
    const { allowPrivate, timeoutMs } = options.config.webhooks;
    this.#agent = new Agent({
      connect: deliveryConnector({ allowPrivate, timeoutMs }),
      keepAliveTimeout: KEEP_ALIVE_MS,
      // The try's own signal bounds it (WEBHOOK_TIMEOUT_MS).
      headersTimeout: 0,
      bodyTimeout: 0,
    });
    this.#forgottenTimer = setInterval(() => this.#lookForForgotten(), FORGOTTEN_CHECK_MS);
    this.#forgottenTimer.unref();
  }

  /** Tries in flight now. */
  get inFlight(): number {
    return this.#tries.size;
  }

  /** Tries in flight now to one endpoint. */
  inFlightTo(endpointId: string): number {
    const slot = this.#endpoints.get(endpointId);
    return slot ? slot.busy : 0;
  }

  /**
   * The deliver_webhook job: claims the message and starts its try in the background. Resolves
   * once the try is started (or there is none to make); rejects only if the database stays out
   * of reach, so that graphile-worker runs the job again. `endpointId`: the message's, when the
   * job names it.
   */
  async deliver(messageId: string, endpointId?: string): Promise<Delivery> {
    const { db } = this.#options;
    endpointId ??= await this.#db(() => findMessageEndpoint(db, messageId));
    if (endpointId === undefined) return 'nothing';
    const id = endpointId;
    if (this.#stopping) {
      // Another worker takes it (or this one, started again).
      await this.#db(() => addDeliveryJob(db, messageId, id, 0));
      return 'deferred';
    }
    const encryptionKeys = this.#encryptionKeys();
    if (!encryptionKeys) {
      await this.#db(() => addDeliveryJob(db, messageId, id, NO_KEY_RETRY_MS));
      return 'deferred';
    }
    const slot = this.#slot(id);
    if (this.#room(slot) < 1) {
      return this.#park(slot, messageId, this.#workerRoom() < 1 ? 'worker_busy' : 'endpoint_busy');
    }
    let claim: Claim;
    try {
      claim = await this.#holding(slot, 1, () => claimMessage(db, messageId, this.workerId, this.#probeMs));
    } catch (error) {
      this.#tidy(slot);
      throw error;
    }
    switch (claim.kind) {
      case 'claimed':
        this.#fly(claim.message, encryptionKeys, slot, claim.probe);
        return 'started';
      case 'paused':
        this.#tidy(slot);
        this.#options.metrics.webhookDeferrals.inc({ reason: 'endpoint_backing_off' });
        // Its endpoint's wake, when the backoff lets a try start.
        await this.#db(() => scheduleWake(db, { endpointId: id, delayMs: 0, deferrals: 0, advance: true }));
        return 'deferred';
      case 'abandoned':
        this.#tidy(slot);
        this.#log.info({ messageId }, 'webhook message abandoned: its endpoint is disabled');
        return 'abandoned';
      case 'nothing':
        this.#tidy(slot);
        return 'nothing';
    }
  }

  /**
   * The wake_webhook_endpoint job: claims the endpoint's waiting messages as room allows, starts
   * their tries, and adds the job again while some still wait (`deferrals`: wakes in a row before
   * this one that found no room for all).
   */
  async wake(endpointId: string, deferrals: number): Promise<Delivery> {
    const { db } = this.#options;
    const again = (delayMs: number, next: number, advance = false) =>
      this.#db(() => scheduleWake(db, { endpointId, delayMs, deferrals: next, advance }));
    if (this.#stopping) {
      await again(0, deferrals);
      return 'deferred';
    }
    if (!this.#encryptionKeys()) {
      await again(NO_KEY_RETRY_MS, deferrals);
      return 'deferred';
    }
    const slot = this.#slot(endpointId);
    if (this.#room(slot) < 1) {
      // A try of this process ending takes them, if another worker's wake does not first.
      this.#setWaiting(slot, true);
      await again(wakeDelay(deferrals + 1), deferrals + 1);
      return 'deferred';
    }
    const claimed = await this.#claimWaiting(slot);
    // The others wait for the probe's end, or the backoff's.
    if (claimed.backingOff) await again(0, 0, true);
    else if (claimed.full) await again(wakeDelay(deferrals + 1), deferrals + 1);
    if (claimed.started > 0) return 'started';
    if (claimed.abandoned > 0) return 'abandoned';
    return claimed.backingOff || claimed.full ? 'deferred' : 'nothing';
  }

  /**
   * Hands back the tries of dead workers (the supervisor's sweep; never those of `live`, and all
   * of those in `dead`, the workers the sweep has just found dead): each is recorded as failed and
   * its message retried at once. Returns how many.
   */
  async recoverLost(deadAfterMs: number, live: readonly string[], limit = 1_000, dead: readonly string[] = []): Promise<number> {
    const recovered = await recoverLostDeliveries(this.#options.db, deadAfterMs, live, limit, dead);
    if (recovered > 0) {
      this.#options.metrics.webhookDeliveries.inc({ outcome: 'failed' }, recovered);
      this.#log.warn({ messages: recovered }, 'webhook tries lost with their worker; retrying them');
    }
    return recovered;
  }

  /**
   * Hands back this process's tries that it has lost track of: its messages delivering that it has
   * no try in flight for, whose try started more than `olderThanMs` ago (by default, more than
   * WEBHOOK_TIMEOUT_MS and FORGOTTEN_AFTER_MS): each is recorded as failed and its message retried
   * at once. Returns how many (FORGOTTEN_BATCH at most).
   */
  async recoverForgotten(olderThanMs = this.#options.config.webhooks.timeoutMs + FORGOTTEN_AFTER_MS): Promise<number> {
    const inFlight = [...this.#tries.values()].map((flight) => flight.messageId);
    const recovered = await recoverForgottenDeliveries(this.#options.db, this.workerId, olderThanMs, inFlight, FORGOTTEN_BATCH);
    if (recovered > 0) {
      this.#options.metrics.webhookDeliveries.inc({ outcome: 'failed' }, recovered);
      this.#log.warn({ messages: recovered }, 'webhook tries lost track of; retrying them');
    }
    return recovered;
  }

  /**
   * One look for forgotten tries at a time. A look that fails is not retried: the next one comes
   * FORGOTTEN_CHECK_MS later (its failure logged at debug level while the database is out of
   * reach: those who wait for it log that).
   */
  #lookForForgotten(): void {
    if (this.#lookingForForgotten || this.#stopping) return;
    this.#lookingForForgotten = this.recoverForgotten()
      .then(
        () => {},
        (error: unknown) =>
          this.#log[isDatabaseUnavailable(error) ? 'debug' : 'warn']({ err: errorSummary(error) }, 'could not look for webhook tries lost track of'),
      )
      .finally(() => {
        this.#lookingForForgotten = undefined;
      });
  }

  /** Takes no more; lets tries in flight finish for SHUTDOWN_GRACE_MS, then aborts the rest (retried at once). */
  stop(): Promise<void> {
    this.#stopped ??= this.#stop();
    return this.#stopped;
  }

  async #stop(): Promise<void> {
    this.#stopping = true;
    clearInterval(this.#forgottenTimer);
    await this.#lookingForForgotten;
    await Promise.allSettled([...this.#claims]);
    await landWithin(this.#options.config.shutdownGraceMs, () => this.#tries.values(), () => this.#abandoning.abort());
    await this.#agent.destroy();
  }

  /** The keys that decrypt the endpoints' secrets; undefined (said once) when there are none. */
  #encryptionKeys(): readonly Buffer[] | undefined {
    const keys = this.#options.config.secretEncryptionKeys;
    if (keys.length > 0) return keys;
    if (!this.#toldNoKey) {
      this.#toldNoKey = true;
      this.#log.error('SECRET_ENCRYPTION_KEY is not set in this worker: webhooks cannot be signed; their messages wait until it is');
    }
    return undefined;
  }

  /** How long a probe keeps the other tries off its endpoint. */
  get #probeMs(): number {
    return this.#options.config.webhooks.timeoutMs + PROBE_MARGIN_MS;
  }

  #slot(endpointId: string): EndpointSlot {
    let slot = this.#endpoints.get(endpointId);
    if (!slot) {
      slot = { id: endpointId, busy: 0, waiting: false, pulling: undefined, again: false };
      this.#endpoints.set(endpointId, slot);
    }
    return slot;
  }

  /** Forgets an endpoint this process has nothing of. */
  #tidy(slot: EndpointSlot): void {
    if (slot.busy === 0 && !slot.waiting && !slot.pulling) this.#endpoints.delete(slot.id);
  }

  #setWaiting(slot: EndpointSlot, waiting: boolean): void {
    slot.waiting = waiting;
    if (waiting) this.#waiting.add(slot);
    else this.#waiting.delete(slot);
  }

  /** Tries this process may start now, whatever their endpoints. */
  #workerRoom(): number {
    return this.#options.config.webhooks.maxInFlight - this.#tries.size - this.#held;
  }

  /** Tries this process may start now to the endpoint. */
  #room(slot: EndpointSlot): number {
    return Math.min(this.#workerRoom(), this.#options.config.webhooks.maxInFlightPerEndpoint - slot.busy);
  }

  /** Runs a claim, holding `room` of the endpoint's (and the process's) room while it runs. */
  async #holding<T>(slot: EndpointSlot, room: number, claim: () => Promise<T>): Promise<T> {
    slot.busy += room;
    this.#held += room;
    const claiming = this.#db(claim);
    this.#claims.add(claiming);
    try {
      return await claiming;
    } finally {
      this.#claims.delete(claiming);
      slot.busy -= room;
      this.#held -= room;
    }
  }

  /**
   * No room for the message here: it waits for its endpoint's wake (added if none is coming),
   * and for room made here. Its job ends.
   */
  async #park(slot: EndpointSlot, messageId: string, reason: DeferralReason): Promise<Delivery> {
    // (before the statement: a try ending meanwhile takes it)
    this.#setWaiting(slot, true);
    const waits = await this.#db(() =>
      scheduleWake(this.#options.db, { endpointId: slot.id, delayMs: wakeDelay(0), deferrals: 0, messageId }),
    );
    if (!waits) return 'nothing';
    this.#options.metrics.webhookDeferrals.inc({ reason });
    return 'deferred';
  }

  /**
   * Claims the endpoint's waiting messages, as many as there is room for, and starts their tries.
   * full: they took all the room (more may wait). backingOff: the endpoint backs off (DueClaim).
   */
  async #claimWaiting(slot: EndpointSlot): Promise<{ started: number; abandoned: number; full: boolean; backingOff: boolean }> {
    const room = this.#room(slot);
    if (room < 1) return { started: 0, abandoned: 0, full: true, backingOff: false };
    const encryptionKeys = this.#encryptionKeys();
    if (!encryptionKeys) return { started: 0, abandoned: 0, full: false, backingOff: false };
    let claim: DueClaim;
    try {
      claim = await this.#holding(slot, room, () => claimDue(this.#options.db, slot.id, this.workerId, room, this.#probeMs));
    } catch (error) {
      this.#tidy(slot);
      throw error;
    }
    for (const { message, probe } of claim.messages) this.#fly(message, encryptionKeys, slot, probe);
    if (claim.abandoned > 0) {
      this.#log.info({ endpointId: slot.id, messages: claim.abandoned }, 'webhook messages abandoned: their endpoint is disabled');
    }
    const full = claim.messages.length + claim.abandoned >= room;
    this.#setWaiting(slot, full && !claim.backingOff);
    this.#tidy(slot);
    return { started: claim.messages.length, abandoned: claim.abandoned, full, backingOff: claim.backingOff };
  }

  /**
   * Offers the room made here to the endpoint's waiting messages: claims them while there is
   * room and some wait, one claim at a time per endpoint.
   */
  #pull(slot: EndpointSlot): void {
    if (slot.pulling) {
      slot.again = true;
      return;
    }
    slot.again = false;
    const pulling: Promise<void> = (async () => {
      while (slot.waiting && !this.#stopping && this.#room(slot) >= 1) {
        slot.again = false;
        const { backingOff } = await this.#claimWaiting(slot);
        // The others wait for its wake, when the backoff lets a try start.
        if (backingOff) {
          await this.#db(() => scheduleWake(this.#options.db, { endpointId: slot.id, delayMs: 0, deferrals: 0, advance: true }));
        }
      }
    })()
      .catch((error: unknown) => {
        // Its wake job comes back for them.
        this.#log.warn({ endpointId: slot.id, err: errorSummary(error) }, 'could not claim waiting webhook messages');
        slot.again = false;
      })
      .finally(() => {
        this.#claims.delete(pulling);
        slot.pulling = undefined;
        if (slot.again) this.#pull(slot);
        else this.#tidy(slot);
      });
    slot.pulling = pulling;
    this.#claims.add(pulling);
  }

  /** A try of the endpoint ended here: its room goes to its waiting messages, then to other endpoints'. */
  #roomMade(slot: EndpointSlot): void {
    if (this.#stopping) return;
    if (slot.waiting) this.#pull(slot);
    for (const other of this.#waiting) {
      if (this.#workerRoom() < 1) break;
      if (other !== slot && !other.pulling && this.#room(other) >= 1) this.#pull(other);
    }
  }

  #fly(message: ClaimedMessage, encryptionKeys: readonly Buffer[], slot: EndpointSlot, probe: boolean): void {
    const controller = new AbortController();
    const stopTimeout = abortAfter(controller, this.#options.config.webhooks.timeoutMs);
    slot.busy++;
    const done = this.#try(message, encryptionKeys, controller.signal, probe, slot).finally(() => {
      stopTimeout();
      this.#tries.delete(controller);
      slot.busy--;
      this.#roomMade(slot);
      this.#tidy(slot);
    });
    this.#tries.set(controller, { controller, done, messageId: message.id });
  }

  /** One try: send, then record how it went. Never rejects. */
  async #try(message: ClaimedMessage, encryptionKeys: readonly Buffer[], signal: AbortSignal, probe: boolean, slot: EndpointSlot): Promise<void> {
    const begun = performance.now();
    let answer: Answer;
    try {
      answer = await this.#send(message, encryptionKeys, signal);
    } catch (error) {
      // A bug on our side (#send classifies every failure it knows): the try still ends, and the
      // message is retried on the schedule.
      this.#log.error({ messageId: message.id, err: errorSummary(error) }, 'webhook try failed unexpectedly');
      answer = { kind: 'failed', httpStatus: null, error: 'the delivery could not be prepared', timedOut: undefined };
    }
    const durationMs = Math.round(performance.now() - begun);
    if (answer.kind === 'failed' && signal.reason === ABORTED_BY_SHUTDOWN) {
      answer = { kind: 'failed', httpStatus: null, error: 'the worker shut down during the try', ours: { retryInMs: 0 }, timedOut: undefined };
    }
    const end: TryEnd = {
      messageId: message.id,
      endpointId: message.endpoint_id,
      tryNumber: message.tries,
      kind: answer.kind,
      httpStatus: answer.httpStatus,
      error: answer.kind === 'delivered' ? null : answer.kind === 'gone' ? 'HTTP 410 Gone: the endpoint is disabled' : answer.error,
      durationMs,
      timedOut: answer.kind === 'failed' ? answer.timedOut : false,
    };
    if (answer.kind === 'failed') {
      // A try cut short by our own shutdown, or that we could not sign, is not the endpoint's
      // failure: it is made again in its place in the schedule (one we could not sign, unless the
      // event is older than the schedule's span: then it is given up). (So are the tries a worker
      // lost: handed back, they leave webhook_messages.failures as it was.)
      end.spendsRetry = answer.ours === undefined;
      end.retryInMs = answer.ours
        ? answer.ours.retryInMs
        : nextTryDelay(this.#options.config.webhooks.retryScheduleMs, message.failures + 1, answer.retryAfterMs);
      // The endpoint asked for a pause, not this message alone: its other messages would meet
      // the same refusal, each spending a retry.
      if (answer.pausesEndpoint && answer.retryAfterMs !== undefined) end.pauseMs = Math.min(answer.retryAfterMs, MAX_RETRY_WAIT_MS);
    }
    const context = { messageId: message.id, endpointId: message.endpoint_id, try: message.tries, httpStatus: answer.httpStatus, durationMs, probe };
    try {
      const status = await this.#db(() => finishTry(this.#options.db, end, ENDPOINT_BACKOFF), { untilAbandoned: true });
      // gateway_webhook_deliveries_total: a try once its end is recorded, and only by the process
      // that records it. Not one the sweep handed back meanwhile (stale: counted as failed by the
      // worker that handed it back), nor one whose end could not be recorded (counted when it is
      // handed back).
      if (status) this.#options.metrics.webhookDeliveries.inc({ outcome: answer.kind === 'delivered' ? 'succeeded' : answer.kind === 'gone' ? 'disabled' : 'failed' });
      if (answer.kind === 'delivered') this.#log.debug({ ...context, stale: !status }, 'webhook delivered');
      else if (answer.kind === 'gone') this.#log.warn({ ...context, stale: !status }, 'webhook endpoint answered 410 Gone: disabled');
      else this.#log.info({ ...context, error: end.error, retryInMs: end.retryInMs, status: status ?? 'stale' }, 'webhook try failed');
      // The endpoint answered its probe: its backoff is over, and its waiting messages go now.
      if (probe && end.timedOut === false) this.#setWaiting(slot, true);
    } catch (error) {
      // Given up at shutdown: the message stays delivering under this worker's id, and is handed
      // back by a sweep once this worker is gone (as when the process is killed while retrying).
      // A failure no retry mends, while the process runs: it hands the message back itself
      // (recoverForgotten).
      this.#log.error({ ...context, err: errorSummary(error) }, 'could not record a webhook try');
    }
  }

  async #send(message: ClaimedMessage, encryptionKeys: readonly Buffer[], signal: AbortSignal): Promise<Answer> {
    // Checked when the endpoint was added, and again at each try: the row may have been changed since.
    const refusal = this.#urlRefusal(message.url);
    if (refusal) return { kind: 'failed', httpStatus: null, error: refusal, timedOut: false };
    let secrets: string[];
    try {
      secrets = [message.secret_ciphertext, message.previous_secret_ciphertext]
        .filter((sealed): sealed is Buffer => sealed !== null)
        .map((sealed) => decryptSecret(sealed, message.endpoint_id, encryptionKeys));
    } catch {
      // This worker's configuration, not the endpoint: the try never reaches it. Another worker
      // (mid-rotation, one given SECRET_ENCRYPTION_KEYS already) may have the key, or this one
      // once it is set right; meanwhile the message waits, later each time, its retries whole.
      // Not for good: a key lost for good would keep it waiting (and its request from retention)
      // forever. Older than the schedule's span, it is given up, as a spent schedule gives it up.
      const givenUp = Date.now() - message.created_at.getTime() >= retryScheduleSpan(this.#options.config.webhooks.retryScheduleMs);
      const retryInMs = givenUp ? undefined : doubling(message.tries - message.failures, NO_KEY_RETRY_MS, SECRET_UNDECRYPTABLE_MAX_RETRY_MS);
      this.#log.error(
        { endpointId: message.endpoint_id, messageId: message.id, retryInMs },
        givenUp
          ? "the webhook endpoint's secret is encrypted with a key this worker does not have (SECRET_ENCRYPTION_KEY(S)): its message was not sent, and is given up, older than WEBHOOK_RETRY_SCHEDULE's span"
          : "the webhook endpoint's secret is encrypted with a key this worker does not have (SECRET_ENCRYPTION_KEY(S)): its message was not sent, and waits",
      );
      return {
        kind: 'failed',
        httpStatus: null,
        error: "the endpoint's secret could not be decrypted: no key of SECRET_ENCRYPTION_KEY(S) is the one it was stored with",
        ours: { retryInMs },
        timedOut: undefined,
      };
    }
    const body = eventBody(message);
    const timestamp = Math.floor(Date.now() / 1000);
    const signatures = await Promise.all(secrets.map((secret) => signWebhook(secret, message.id, timestamp, body)));
    let response: Awaited<ReturnType<typeof request>>;
    try {
      response = await request(message.url, {
        method: 'POST',
        headers: {
          'content-type': 'application/json',
          'user-agent': 'chat-gateway-webhooks',
          'webhook-id': message.id,
          'webhook-timestamp': String(timestamp),
          'webhook-signature': signatures.join(' '),
        },
        body,
        signal,
        dispatcher: this.#agent,
      });
    } catch (error) {
      return { kind: 'failed', httpStatus: null, ...this.#failureOf(error, signal) };
    }
    const status = response.statusCode;
    // Read and dropped, so that the connection can carry the next try.
    await response.body.dump({ limit: MAX_ANSWER_BYTES }).catch(() => {});
    // An answer still unfinished at the timeout is no answer, whatever its status said: the
    // endpoint held the try as one that never answers does.
    if (signal.aborted && signal.reason === ABORTED_BY_TIMEOUT) {
      const error = `HTTP ${status} without the rest of its answer within ${this.#options.config.webhooks.timeoutMs / 1000} s`;
      return { kind: 'failed', httpStatus: status, error, timedOut: true };
    }
    if (status >= 200 && status < 300) return { kind: 'delivered', httpStatus: status };
    if (status === 410) return { kind: 'gone', httpStatus: status };
    const retryAfter = response.headers['retry-after'];
    return {
      kind: 'failed',
      httpStatus: status,
      error: `HTTP ${status}`,
      retryAfterMs: parseRetryAfter((Array.isArray(retryAfter) ? retryAfter[0] : retryAfter) ?? null),
      pausesEndpoint: status === 429 || status === 503,
      timedOut: false,
    };
  }

  /** Why no try may be made to this URL, in our words; undefined when one may. */
  #urlRefusal(text: string): string | undefined {
    const url = URL.parse(text);
    if (url === null) return 'the endpoint URL is not a valid absolute URL';
    if (this.#options.config.webhooks.allowPrivate) {
      return isAllowedScheme(url, true) ? undefined : `the endpoint URL must be https:// or http:// (it is ${url.protocol})`;
    }
    return isAllowedScheme(url, false) ? undefined : `the endpoint URL must be https:// (it is ${url.protocol}); WEBHOOK_ALLOW_PRIVATE is off`;
  }

  /** Why a try got no answer, in our words; timedOut: whether it waited for one until the timeout. */
  #failureOf(error: unknown, signal: AbortSignal): { error: string; timedOut: boolean | undefined } {
    if (signal.aborted) {
      return signal.reason === ABORTED_BY_TIMEOUT
        ? { error: `no answer within ${this.#options.config.webhooks.timeoutMs / 1000} s`, timedOut: true }
        : { error: 'the try was aborted', timedOut: undefined };
    }
    const forbidden = findCause(error, (cause) => cause instanceof ForbiddenAddressError);
    if (forbidden) return { error: (forbidden as ForbiddenAddressError).message, timedOut: false };
    const failure = connectionFailure(error);
    if (!failure.known) this.#log.warn({ err: errorSummary(error) }, 'webhook try failed unexpectedly');
    return { error: failure.says, timedOut: failure.timedOut };
  }

  /**
   * Runs a statement, retrying while the database is unavailable (for OUTAGE_PATIENCE_MS, or
   * `untilAbandoned`) and when it lost to a concurrent transaction: a probe's claim and a 410's
   * end, say, lock the same endpoint and message rows in opposite orders, and Postgres may break
   * their deadlock by failing either. Each statement here is a transaction of its own.
   */
  #db<T>(statement: () => Promise<T>, options: { untilAbandoned?: boolean } = {}): Promise<T> {
    return whileUnavailable(statement, {
      ...(options.untilAbandoned ? { signal: this.#abandoning.signal } : { maxWaitMs: OUTAGE_PATIENCE_MS }),
      conflicts: CONFLICT_RETRIES,
      log: { logger: this.#log, message: 'database unavailable; retrying' },
    });
  }
}
