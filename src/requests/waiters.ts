// In-memory fan-out of "request finished" events to the wait=true requests of this process.
//
// The process's LISTEN connection (db/listener.ts) receives the ids that the
// requests_notify_finished trigger publishes; a worker in the same process also reports the
// outcomes it records, a completion with its result. The database stays the truth: a wake-up
// tells a waiter to read its row again, and a result is handed over only once it is committed.
// While the worker of this process records a request's outcome, a NOTIFY for that request (which
// often comes before the recording's own answer) waits for the recording to end, so that its
// waiters are answered from it rather than read the row. While the LISTEN connection is down,
// waiters re-read their rows on a short interval instead, and every waiter re-reads once it is
// back, so no completion is missed.
import type { Listener } from '../db/listener.ts';

export const FINISHED_CHANNEL = 'gateway_requests_finished';
const POLL_WHILE_DISCONNECTED_MS = 500;

/**
 * changed: read the row again. completed: the request completed, with `Watch.result` (committed).
 * timeout: the time given is over. aborted: the caller gave up. closed: shutting down.
 */
export type WatchEvent = 'changed' | 'completed' | 'timeout' | 'aborted' | 'closed';

export interface Watch {
  readonly id: string;
  /** The result the request completed with, once a 'completed' event has said so. */
  readonly result: string | undefined;
  /**
   * Resolves at the next wake-up of this id (or at once if one came since the last call). A
   * call while the last one is still pending settles that one ('changed').
   */
  next(timeoutMs: number): Promise<WatchEvent>;
  /**
   * Resolves once a result is handed over (at once if one was): what a waiter reading its row
   * races against, as a worker of this process hands the result over a moment after its NOTIFY
   * may have arrived.
   */
  handedOver(): Promise<void>;
  /** The caller gave up (its client hung up): this wait, or the next, ends with 'aborted'. */
  abort(): void;
  /** Stops watching; call it in a finally block. */
  close(): void;
}

export class Waiters {
  // One watch per id almost always; an array when idempotent replays wait on the same request.
  readonly #subscribers = new Map<string, Subscription | Subscription[]>();
  readonly #listener: Listener;
  // Requests whose outcome this process's worker is recording, and those of them that a
  // wake-up came for meanwhile.
  readonly #recording = new Set<string>();
  readonly #deferred = new Set<string>();
  #closed = false;

  constructor(listener: Listener) {
    this.#listener = listener;
    listener.subscribe(FINISHED_CHANNEL, {
      notification: (payload) => this.wake(payload.split(',')),
      // Waiters switch to polling, and read their rows again once notifications are back.
      lost: () => this.#wakeEvery('changed'),
      restored: () => this.#wakeEvery('changed'),
    });
  }

  /** Number of wait=true requests currently held open in this process. */
  get size(): number {
    let size = 0;
    for (const entry of this.#subscribers.values()) size += Array.isArray(entry) ? entry.length : 1;
    return size;
  }

  get closed(): boolean {
    return this.#closed;
  }

  /** Without a LISTEN connection nobody will wake a waiter: it must come back soon to read its row. */
  get polling(): boolean {
    return !this.#listener.listening;
  }

  /** Subscribe before reading the row: a completion between the read and the wait is then not lost. */
  watch(id: string): Watch {
    const subscription = new Subscription(id, this);
    const entry = this.#subscribers.get(id);
    if (entry === undefined) this.#subscribers.set(id, subscription);
    else if (Array.isArray(entry)) entry.push(subscription);
    else this.#subscribers.set(id, [entry, subscription]);
    return subscription;
  }

  /**
   * Tells the waiters of these ids to read their rows again; those of a request whose outcome
   * this process is recording, once the recording is over.
   */
  wake(ids: Iterable<string>): void {
    for (const id of ids) {
      const entry = this.#subscribers.get(id);
      if (entry === undefined) continue;
      if (this.#recording.has(id)) this.#deferred.add(id);
      else wakeEntry(entry, 'changed');
    }
  }

  /** The worker of this process is about to record an outcome of this request. */
  recording(id: string): void {
    if (this.#subscribers.has(id)) this.#recording.add(id);
  }

  /**
   * The worker of this process has recorded an outcome of this request (or given up): a
   * completion's committed result is handed over, and the waiters of a request that failed, or
   * that a wake-up came for meanwhile, read their rows.
   */
  recorded(id: string, outcome: { result?: string; ended: boolean }): void {
    this.#recording.delete(id);
    const deferred = this.#deferred.delete(id);
    const entry = this.#subscribers.get(id);
    if (entry === undefined) return;
    if (outcome.result !== undefined) {
      for (const subscription of Array.isArray(entry) ? entry : [entry]) subscription.complete(outcome.result);
    } else if (outcome.ended || deferred) {
      wakeEntry(entry, 'changed');
    }
  }

  /** Answers every waiter: they fall back to the acknowledgement. */
  close(): void {
    this.#closed = true;
    this.#wakeEvery('closed');
  }

  /** @internal Subscription.close() */
  unsubscribe(subscription: Subscription): void {
    const entry = this.#subscribers.get(subscription.id);
    if (entry === subscription) this.#subscribers.delete(subscription.id);
    else if (Array.isArray(entry)) {
      const index = entry.indexOf(subscription);
      if (index >= 0) entry.splice(index, 1);
      if (entry.length === 1) this.#subscribers.set(subscription.id, entry[0]!);
    }
  }

  #wakeEvery(event: WatchEvent): void {
    for (const entry of this.#subscribers.values()) wakeEntry(entry, event);
  }
}

function wakeEntry(entry: Subscription | Subscription[], event: WatchEvent): void {
  if (!Array.isArray(entry)) entry.wake(event);
  else for (const subscription of entry) subscription.wake(event);
}

/**
 * One waiter. Thousands may wait at once (each holding a connection), so a waiter is one
 * object: no closures, and a timer that carries it as its argument.
 */
class Subscription implements Watch {
  readonly id: string;
  readonly #waiters: Waiters;
  #pending = false;
  #aborted = false;
  #polling = false;
  #result: string | undefined = undefined;
  #handedOver: (() => void) | undefined = undefined;
  #resolve: ((event: WatchEvent) => void) | undefined = undefined;
  #timer: NodeJS.Timeout | undefined = undefined;

  constructor(id: string, waiters: Waiters) {
    this.id = id;
    this.#waiters = waiters;
  }

  get result(): string | undefined {
    return this.#result;
  }

  next(timeoutMs: number): Promise<WatchEvent> {
    // A caller that raced the last call against something else has moved on: settle it, so
    // that its timer cannot end this one.
    if (this.#resolve) this.#finish('changed');
    if (this.#waiters.closed) return Promise.resolve('closed');
    if (this.#aborted) return Promise.resolve('aborted');
    if (this.#pending) {
      this.#pending = false;
      return Promise.resolve(this.#result === undefined ? 'changed' : 'completed');
    }
    this.#polling = this.#waiters.polling && timeoutMs > POLL_WHILE_DISCONNECTED_MS;
    const sleepMs = this.#polling ? POLL_WHILE_DISCONNECTED_MS : timeoutMs;
    return new Promise<WatchEvent>((resolve) => {
      this.#resolve = resolve;
      this.#timer = setTimeout(timedOut, sleepMs, this);
    });
  }

  wake(event: WatchEvent): void {
    if (this.#resolve) this.#finish(event);
    else if (event === 'changed' || event === 'completed') this.#pending = true;
  }

  complete(result: string): void {
    this.#result = result;
    this.#handedOver?.();
    this.#handedOver = undefined;
    this.wake('completed');
  }

  handedOver(): Promise<void> {
    if (this.#result !== undefined) return Promise.resolve();
    return new Promise((resolve) => {
      this.#handedOver = resolve;
    });
  }

  abort(): void {
    this.#aborted = true;
    if (this.#resolve) this.#finish('aborted');
  }

  close(): void {
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    this.#timer = undefined;
    this.#resolve = undefined;
    this.#handedOver = undefined;
    this.#waiters.unsubscribe(this);
  }

  /** @internal the timer of next() */
  timedOut(): void {
    this.#timer = undefined;
    if (this.#resolve) this.#finish(this.#polling ? 'changed' : 'timeout');
  }

  #finish(event: WatchEvent): void {
    const resolve = this.#resolve!;
    this.#resolve = undefined;
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    this.#timer = undefined;
    resolve(event);
  }
}

function timedOut(subscription: Subscription): void {
  subscription.timedOut();
}
