// In-memory fan-out of "request finished" events to the wait=true requests of this process.
//
// One LISTEN connection per process receives the ids that the requests_notify_finished
// trigger publishes; a worker in the same process also reports its own completions directly.
// The database stays the truth: a wake-up only tells a waiter to read its row again. While the
// LISTEN connection is down, waiters re-read their rows on a short interval instead, and every
// waiter re-reads once the connection is back, so no completion is missed.
import pg from 'pg';
import { errorSummary } from '../db/pool.ts';
import type { Logger } from '../logger.ts';

export const FINISHED_CHANNEL = 'gateway_requests_finished';
const POLL_WHILE_DISCONNECTED_MS = 500;
const RECONNECT_MIN_MS = 100;
const RECONNECT_MAX_MS = 1_000;

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
  readonly #connectionString: string;
  readonly #logger: Logger;
  #client: pg.Client | undefined;
  #listening = false;
  #closed = false;
  #reconnectDelay = RECONNECT_MIN_MS;
  #reconnectTimer: NodeJS.Timeout | undefined;

  constructor(connectionString: string, logger: Logger) {
    this.#connectionString = connectionString;
    this.#logger = logger.child({ component: 'waiters' });
  }

  /** Connects and LISTENs; rejects if the first connection fails. */
  async start(): Promise<void> {
    await this.#connect();
  }

  /** Number of wait=true requests currently held open in this process. */
  get size(): number {
    let size = 0;
    for (const set of this.#subscribers.values()) size += set.size;
    return size;
  }

  get listening(): boolean {
    return this.#listening;
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
        const polling = !this.#listening && timeoutMs > POLL_WHILE_DISCONNECTED_MS;
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

  /** Answers every waiter (they fall back to the acknowledgement) and closes the connection. */
  async close(): Promise<void> {
    this.#closed = true;
    clearTimeout(this.#reconnectTimer);
    for (const set of this.#subscribers.values()) for (const subscriber of set) subscriber.wake('closed');
    const client = this.#client;
    this.#client = undefined;
    this.#listening = false;
    await client?.end().catch(() => {});
  }

  #wakeAll(): void {
    for (const set of this.#subscribers.values()) for (const subscriber of set) subscriber.wake('changed');
  }

  async #connect(): Promise<void> {
    const client = new pg.Client({
      connectionString: this.#connectionString,
      application_name: 'gateway-listen',
      keepAlive: true,
      connectionTimeoutMillis: 5_000,
    });
    client.on('notification', (message) => {
      if (message.channel === FINISHED_CHANNEL && message.payload) this.wake(message.payload.split(','));
    });
    client.on('error', (error) => this.#lost(client, error));
    client.on('end', () => this.#lost(client));
    try {
      await client.connect();
      await client.query(`listen ${FINISHED_CHANNEL}`);
    } catch (error) {
      client.removeAllListeners('end');
      await client.end().catch(() => {});
      throw error;
    }
    if (this.#closed) {
      await client.end().catch(() => {});
      return;
    }
    this.#client = client;
    this.#listening = true;
    this.#reconnectDelay = RECONNECT_MIN_MS;
  }

  #lost(client: pg.Client, error?: Error): void {
    if (this.#closed || this.#client !== client) return;
    this.#client = undefined;
    this.#listening = false;
    client.end().catch(() => {});
    this.#logger.warn({ err: error && errorSummary(error) }, 'LISTEN connection lost; waiters poll until it is back');
    this.#wakeAll();
    this.#scheduleReconnect();
  }

  #scheduleReconnect(): void {
    if (this.#closed) return;
    const delay = this.#reconnectDelay;
    this.#reconnectDelay = Math.min(this.#reconnectDelay * 2, RECONNECT_MAX_MS);
    this.#reconnectTimer = setTimeout(() => {
      this.#connect().then(
        () => {
          this.#logger.info('LISTEN connection restored');
          // Completions published while we were away were not heard: everyone reads again.
          this.#wakeAll();
        },
        (error: unknown) => {
          this.#logger.debug({ err: errorSummary(error) }, 'LISTEN reconnection failed');
          this.#scheduleReconnect();
        },
      );
    }, delay);
  }
}
