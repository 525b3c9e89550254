// In-memory fan-out of "request finished" events to the wait=true requests of this process.
//
// The process's LISTEN connection (db/listener.ts) receives the ids that the
// requests_notify_finished trigger publishes; a worker in the same process also reports its
// own completions directly. The database stays the truth: a wake-up only tells a waiter to read
// its row again. While the LISTEN connection is down, waiters re-read their rows on a short
// interval instead, and every waiter re-reads once it is back, so no completion is missed.
import { setMaxListeners } from 'node:events';
import type { Listener } from '../db/listener.ts';

export const FINISHED_CHANNEL = 'gateway_requests_finished';
const POLL_WHILE_DISCONNECTED_MS = 500;

/** changed: read the row again. timeout: the time given is over. aborted: the caller gave up. closed: shutting down. */
export type WatchEvent = 'changed' | 'timeout' | 'aborted' | 'closed';

export interface Watch {
  readonly id: string;
  /** Resolves at the next wake-up of this id (or at once if one came since the last call). */
  next(timeoutMs: number, signal?: AbortSignal): Promise<WatchEvent>;
  /** Stops watching; call it in a finally block. */
  close(): void;
}

interface Subscriber {
  wake(event: WatchEvent): void;
}

export class Waiters {
  readonly #subscribers = new Map<string, Set<Subscriber>>();
  readonly #listener: Listener;
  readonly #closing = new AbortController();
  #closed = false;

  constructor(listener: Listener) {
    this.#listener = listener;
    // Every local wait listens to it: as many listeners as waiting requests.
    setMaxListeners(0, this.#closing.signal);
    listener.subscribe(FINISHED_CHANNEL, {
      notification: (payload) => this.wake(payload.split(',')),
      // Waiters switch to polling, and read their rows again once notifications are back.
      lost: () => this.#wakeAll(),
      restored: () => this.#wakeAll(),
    });
  }

  /** Aborted when close() answers every waiter (for waits that do not go through watch()). */
  get closing(): AbortSignal {
    return this.#closing.signal;
  }

  /** Number of wait=true requests currently held open in this process. */
  get size(): number {
    let size = 0;
    for (const set of this.#subscribers.values()) size += set.size;
    return size;
  }

  /** Subscribe before reading the row: a completion between the read and the wait is then not lost. */
  watch(id: string): Watch {
    let pending = false;
    let resolveNext: ((event: WatchEvent) => void) | undefined;
    const subscriber: Subscriber = {
      wake: (event) => {
        if (resolveNext) resolveNext(event);
        else if (event === 'changed') pending = true;
      },
    };
    let set = this.#subscribers.get(id);
    if (!set) this.#subscribers.set(id, (set = new Set()));
    set.add(subscriber);

    return {
      id,
      next: (timeoutMs, signal) => {
        if (this.#closed) return Promise.resolve('closed');
        if (signal?.aborted) return Promise.resolve('aborted');
        if (pending) {
          pending = false;
          return Promise.resolve('changed');
        }
        // Without a LISTEN connection nobody will wake us: come back soon to read the row.
        const polling = !this.#listener.listening && timeoutMs > POLL_WHILE_DISCONNECTED_MS;
        const sleepMs = polling ? POLL_WHILE_DISCONNECTED_MS : timeoutMs;
        return new Promise<WatchEvent>((resolve) => {
          const finish = (event: WatchEvent) => {
            clearTimeout(timer);
            signal?.removeEventListener('abort', onAbort);
            resolveNext = undefined;
            resolve(event);
          };
          const onAbort = () => finish('aborted');
          const timer = setTimeout(() => finish(polling ? 'changed' : 'timeout'), sleepMs);
          signal?.addEventListener('abort', onAbort, { once: true });
          resolveNext = finish;
        });
      },
      close: () => {
        set.delete(subscriber);
        if (set.size === 0 && this.#subscribers.get(id) === set) this.#subscribers.delete(id);
      },
    };
  }

  /** Tells the waiters of these ids to read their rows again. */
  wake(ids: Iterable<string>): void {
    for (const id of ids) {
      const set = this.#subscribers.get(id);
      if (set) for (const subscriber of set) subscriber.wake('changed');
    }
  }

  /** Answers every waiter: they fall back to the acknowledgement. */
  close(): void {
    this.#closed = true;
    this.#closing.abort();
    for (const set of this.#subscribers.values()) for (const subscriber of set) subscriber.wake('closed');
  }

  #wakeAll(): void {
    for (const set of this.#subscribers.values()) for (const subscriber of set) subscriber.wake('changed');
  }
}
