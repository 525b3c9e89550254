// One LISTEN connection per process, shared by everything that reacts to NOTIFY: waiters
// (requests finished), the key cache (keys revoked) and the dispatcher (its calls' requests
// ended). It reconnects by itself; since notifications sent while it was away are lost,
// subscribers are told when it is lost and when it is back, and whether it is listening right
// now, so they can fall back to reading the database.
//
// A connection can also die without a word: a NAT or load balancer forgets an idle flow, a
// failover sends no reset. No error or end event comes until TCP gives up, hours later, and
// meanwhile every NOTIFY is missed. So the connection is asked a round trip regularly, and one
// that does not answer in time is treated as lost.
import pg from 'pg';
import { Backoff } from '../client/backoff.ts';
import type { Logger } from '../logger.ts';
import { errorSummary } from './pool.ts';

const RECONNECT_MIN_MS = 100;
const RECONNECT_MAX_MS = 1_000;
// A dead connection is found within PROBE_EVERY_MS + PROBE_TIMEOUT_MS (8 s) of its death, so
// that subscribers fall back to the database within 10 s. The timeout leaves a loaded Postgres
// time to answer `select 1`, and is longer than a pause of this process's own event loop (a GC
// pause, a busy second or two) that delays reading the answer.
const PROBE_EVERY_MS = 5_000;
const PROBE_TIMEOUT_MS = 3_000;
// The kernel's keepalive probes the socket once it has been idle this long (the OS default is
// 2 h), so that the flow stays known to middleboxes even while this process's round trips are
// held up; the round trips, not the keepalive, are what find a dead connection in time.
const KEEPALIVE_DELAY_MS = 10_000;

export interface ListenerEvents {
  /** A notification on the channel; the payload as sent. */
  notification(payload: string): void;
  /** The connection was lost: notifications may be missed until `restored`. */
  lost?(): void;
  /** Listening again after a loss: whatever was sent meanwhile was missed. */
  restored?(): void;
}

/** A round trip whose answer did not come within PROBE_TIMEOUT_MS. */
class Unanswered extends Error {
  override name = 'Unanswered';
}

export class Listener {
  readonly #connectionString: string;
  readonly #logger: Logger;
  readonly #subscribers = new Map<string, ListenerEvents[]>();
  #client: pg.Client | undefined;
  #listening = false;
  #closed = false;
  readonly #reconnectDelay = new Backoff(RECONNECT_MIN_MS, RECONNECT_MAX_MS);
  #reconnectTimer: NodeJS.Timeout | undefined;
  #probeTimer: NodeJS.Timeout | undefined;

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
    clearTimeout(this.#probeTimer);
    const client = this.#client;
    this.#client = undefined;
    this.#listening = false;
    // At once: a connection gone silent (not yet found dead) never answers end()'s goodbye, and
    // a shutdown would wait for it until TCP gives up.
    if (client) destroy(client);
  }

  #each(call: (events: ListenerEvents) => void): void {
    for (const list of this.#subscribers.values()) for (const events of list) call(events);
  }

  async #connect(): Promise<void> {
    const client = new pg.Client({
      connectionString: this.#connectionString,
      application_name: 'gateway-listen',
      keepAlive: true,
      keepAliveInitialDelayMillis: KEEPALIVE_DELAY_MS,
      connectionTimeoutMillis: 5_000,
    });
    client.on('notification', (message) => {
      for (const events of this.#subscribers.get(message.channel) ?? []) events.notification(message.payload ?? '');
    });
    client.on('error', (error) => this.#lost(client, error));
    client.on('end', () => this.#lost(client));
    try {
      await client.connect();
      for (const channel of this.#subscribers.keys()) await roundTrip(client, `listen ${channel}`);
    } catch (error) {
      client.removeAllListeners('end');
      destroy(client);
      throw error;
    }
    if (this.#closed) {
      await client.end().catch(() => {});
      return;
    }
    this.#client = client;
    this.#listening = true;
    this.#reconnectDelay.reset();
    this.#probeLater(client);
  }

  #probeLater(client: pg.Client): void {
    this.#probeTimer = setTimeout(() => {
      roundTrip(client, 'select 1').then(
        () => {
          if (this.#client === client) this.#probeLater(client);
        },
        (error: unknown) => this.#lost(client, error),
      );
    }, PROBE_EVERY_MS);
  }

  #lost(client: pg.Client, error?: unknown): void {
    if (this.#closed || this.#client !== client) return;
    this.#client = undefined;
    this.#listening = false;
    clearTimeout(this.#probeTimer);
    destroy(client);
    if (error instanceof Unanswered) {
      this.#logger.warn({ timeoutMs: PROBE_TIMEOUT_MS }, 'LISTEN connection found dead: a round trip went unanswered; reconnecting');
    } else {
      this.#logger.warn({ err: error === undefined ? undefined : errorSummary(error) }, 'LISTEN connection lost; reconnecting');
    }
    this.#each((events) => events.lost?.());
    this.#scheduleReconnect();
  }

  #scheduleReconnect(): void {
    if (this.#closed) return;
    this.#reconnectTimer = setTimeout(() => {
      this.#connect().then(
        () => {
          if (this.#closed) return;
          this.#logger.info('LISTEN connection restored');
          this.#each((events) => events.restored?.());
        },
        (error: unknown) => {
          this.#logger.debug({ err: errorSummary(error) }, 'LISTEN reconnection failed');
          this.#scheduleReconnect();
        },
      );
    }, this.#reconnectDelay.next());
  }
}

/** Runs the statement; rejects with Unanswered if its answer has not come within PROBE_TIMEOUT_MS. */
function roundTrip(client: pg.Client, text: string): Promise<void> {
  return new Promise((resolve, reject) => {
    let answered = false;
    const timer = setTimeout(() => {
      // Timers run before sockets are read: after a pause of this process, the answer may be
      // waiting unread. setImmediate runs once it has been read.
      setImmediate(() => {
        if (!answered) reject(new Unanswered(`no answer to ${text} within ${PROBE_TIMEOUT_MS} ms`));
      });
    }, PROBE_TIMEOUT_MS);
    client.query(text).then(
      () => {
        answered = true;
        clearTimeout(timer);
        resolve();
      },
      (error: unknown) => {
        answered = true;
        clearTimeout(timer);
        reject(error);
      },
    );
  });
}

/** Closes the client at once: end() alone waits for the server to close the socket, which a dead connection never does. */
function destroy(client: pg.Client): void {
  client.end().catch(() => {});
  client.connection.stream.destroy();
}
