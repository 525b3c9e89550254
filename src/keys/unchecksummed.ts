// Whether an active key without a checksum may exist: one made before keys ended with one
// (ids.ts), which only a database read can judge. While none does, an API process refuses a key
// of that form from its text alone, as it refuses one that fails its checksum, so that a flood of
// made-up keys of the old form costs no read either (a deployment that still has such keys reads
// them, within the bound of reads.ts).
//
// The database is the truth (gateway.api_keys.checksummed, sql/000023.sql), and the process
// believes "none" only while it hears every change of a key: after a read that found none, with
// its LISTEN connection up, and no announcement since. A key's creation (a gateway of an earlier
// version stores every key it makes as without a checksum) or the connection's loss turns it back
// to "may exist" at once, and any announcement (a revocation may have taken the last one) has it
// read again.
import { errorSummary, type Db } from '../db/pool.ts';
import type { Listener } from '../db/listener.ts';
import type { Logger } from '../logger.ts';
import { CREATED, KEYS_CHANNEL } from './cache.ts';
import { unchecksummedKeysRemain } from './repository.ts';

/** How long after a failed read it is tried again. */
const RETRY_MS = 5_000;

export class UnchecksummedKeys {
  readonly #db: Db;
  readonly #listener: Listener;
  readonly #logger: Logger;
  /** A read found none, and nothing was announced or lost since it began. */
  #none = false;
  /** Counts announcements and losses: a read that saw one while under way decides nothing. */
  #changes = 0;
  #reading: Promise<void> | undefined;
  #readAgain = false;
  #retryTimer: NodeJS.Timeout | undefined;
  #stopped = false;

  constructor(db: Db, listener: Listener, logger: Logger) {
    this.#db = db;
    this.#listener = listener;
    this.#logger = logger.child({ component: 'keys' });
    listener.subscribe(KEYS_CHANNEL, {
      notification: (payload) => {
        this.#changes++;
        if (payload.startsWith(CREATED)) this.#none = false;
        void this.read();
      },
      lost: () => {
        this.#changes++;
        this.#none = false;
      },
      restored: () => void this.read(),
    });
  }

  /** false only while no active key without a checksum exists, as far as this process can tell. */
  mayExist(): boolean {
    return !(this.#none && this.#listener.listening);
  }

  /** Reads whether any remain (once more after a read under way, which may have begun too early). */
  read(): Promise<void> {
    if (this.#stopped) return Promise.resolve();
    if (this.#reading) {
      this.#readAgain = true;
      return this.#reading;
    }
    clearTimeout(this.#retryTimer);
    this.#reading = this.#readOnce().finally(() => {
      this.#reading = undefined;
      if (this.#readAgain) {
        this.#readAgain = false;
        void this.read();
      }
    });
    return this.#reading;
  }

  /** Stops reading; waits for a read under way. */
  async stop(): Promise<void> {
    this.#stopped = true;
    clearTimeout(this.#retryTimer);
    await this.#reading;
  }

  async #readOnce(): Promise<void> {
    const changes = this.#changes;
    let remain: boolean;
    try {
      remain = await unchecksummedKeysRemain(this.#db);
    } catch (error) {
      this.#logger.warn({ err: errorSummary(error) }, 'could not read whether keys without a checksum remain; such keys are read meanwhile');
      if (!this.#stopped) this.#retryTimer = setTimeout(() => void this.read(), RETRY_MS);
      return;
    }
    if (changes !== this.#changes || !this.#listener.listening) return;
    if (remain === !this.#none) return;
    this.#none = !remain;
    this.#logger.info(
      remain
        ? 'an active key without a checksum exists: keys of that form are read'
        : 'no active key without a checksum remains: keys of that form are refused without a read',
    );
  }
}
