// One LISTEN connection per process, shared by everything that reacts to NOTIFY: waiters
// (requests finished) and the key cache (keys revoked). It reconnects by itself; since
// notifications sent while it was away are lost, subscribers are told when it is back, and
// whether it is listening right now, so they can fall back to reading the database.
import pg from 'pg';
import type { Logger } from '../logger.ts';
import { errorSummary } from './pool.ts';

const RECONNECT_MIN_MS = 100;
const RECONNECT_MAX_MS = 1_000;

export interface ListenerEvents {
  /** A notification on the channel; the payload as sent. */
  notification(payload: string): void;
  /** The connection was lost: notifications may be missed until `restored`. */
  lost?(): void;
  /** Listening again after a loss: whatever was sent meanwhile was missed. */
  restored?(): void;
}

export class Listener {
  readonly #connectionString: string;
  readonly #logger: Logger;
  readonly #subscribers = new Map<string, ListenerEvents[]>();
  #client: pg.Client | undefined;
  #listening = false;
  #closed = false;
  #reconnectDelay = RECONNECT_MIN_MS;
  #reconnectTimer: NodeJS.Timeout | undefined;

  constructor(connectionString: string, logger: Logger) {
    this.#connectionString = connectionString;
    this.#logger = logger.child({ component: 'listener' });
  }

  /** Subscribe before start(). */
  subscribe(channel: string, events: ListenerEvents): void {
    if (!/^[a-z_]+$/.test(channel)) throw new Error(`unexpected channel name ${channel}`);
    this.#subscribers.set(channel, [...(this.#subscribers.get(channel) ?? []), events]);
  }

  /** Connects and LISTENs; rejects if the first connection fails. */
  async start(): Promise<void> {
    await this.#connect();
  }

  get listening(): boolean {
    return this.#listening;
  }

  async close(): Promise<void> {
    this.#closed = true;
    clearTimeout(this.#reconnectTimer);
    const client = this.#client;
    this.#client = undefined;
    this.#listening = false;
    await client?.end().catch(() => {});
  }

  #each(call: (events: ListenerEvents) => void): void {
    for (const list of this.#subscribers.values()) for (const events of list) call(events);
  }

  async #connect(): Promise<void> {
    const client = new pg.Client({
      connectionString: this.#connectionString,
      application_name: 'gateway-listen',
      keepAlive: true,
      connectionTimeoutMillis: 5_000,
    });
    client.on('notification', (message) => {
      for (const events of this.#subscribers.get(message.channel) ?? []) events.notification(message.payload ?? '');
    });
    client.on('error', (error) => this.#lost(client, error));
    client.on('end', () => this.#lost(client));
    try {
      await client.connect();
      for (const channel of this.#subscribers.keys()) await client.query(`listen ${channel}`);
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
    this.#logger.warn({ err: error && errorSummary(error) }, 'LISTEN connection lost; reconnecting');
    this.#each((events) => events.lost?.());
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
          this.#each((events) => events.restored?.());
        },
        (error: unknown) => {
          this.#logger.debug({ err: errorSummary(error) }, 'LISTEN reconnection failed');
          this.#scheduleReconnect();
        },
      );
    }, delay);
  }
}
