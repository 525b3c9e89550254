// Which active keys lack a checksum: those made before keys ended with one (ids.ts), which only a
// database read can judge. An API process keeps their hashes (MAX_KNOWN at most) and refuses
// any other key of that form from its text and hash alone, as it refuses one that fails its
// checksum, so that a flood of made-up keys of the old form costs no read, in a deployment that
// still has such keys as in one that has none. With more of them than it keeps, it reads every
// key of that form (within the bound of reads.ts).
//
// The database is the truth (gateway.api_keys.checksummed, sql/000023.sql), and the process
// trusts its list only while it hears every change of a key: after a read, with its LISTEN
// connection up, and no change announced since. A change of any key (its creation: a gateway of
// an earlier version stores every key it makes as without a checksum; its revocation; an edit in
// psql) or the connection's loss makes every key of that form a possible one at once, until a
// read after it.
import { errorSummary, type Db } from '../db/pool.ts';
import type { Listener } from '../db/listener.ts';
import type { Logger } from '../logger.ts';
import { KEYS_CHANNEL } from './cache.ts';
import { unchecksummedKeyHashes } from './repository.ts';

/** How long after a failed read it is tried again. */
const RETRY_MS = 5_000;

/**
 * Active keys without a checksum whose hashes a process keeps at most (some 4 MB of memory, and
 * a read of some 4 MB at each change of a key); with more, every key of that form is read.
 */
export const MAX_KNOWN = 50_000;

export class UnchecksummedKeys {
  readonly #db: Db;
  readonly #listener: Listener;
  readonly #logger: Logger;
  /**
   * The hashes (base64) of every active key without a checksum, from a read with no change
   * announced nor connection lost since it began; undefined while there is no such read, or when
   * there were more than MAX_KNOWN.
   */
  #known: Set<string> | undefined;
  /** What the last read logged: how many it found, or that they were too many to keep. */
  #logged: number | 'too many' | undefined;
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
      notification: () => {
        this.#changes++;
        this.#known = undefined;
        void this.read();
      },
      lost: () => {
        this.#changes++;
        this.#known = undefined;
      },
      restored: () => void this.read(),
    });
  }

  /**
   * false only while this process knows every active key without a checksum, and the key with
   * this hash is none of them: a key of that form is then refused without a read.
   */
  mayBeActive(keySha256: Buffer): boolean {
    if (this.#known === undefined || !this.#listener.listening) return true;
    return this.#known.has(keySha256.toString('base64'));
  }

  /** How many active keys without a checksum this process knows of; undefined while it does not know them all. */
  get known(): number | undefined {
    return this.#listener.listening ? this.#known?.size : undefined;
  }

  /** Reads which remain (once more after a read under way, which may have begun too early). */
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
    let hashes: Buffer[];
    try {
      hashes = await unchecksummedKeyHashes(this.#db, MAX_KNOWN);
    } catch (error) {
      this.#logger.warn({ err: errorSummary(error) }, 'could not read which keys without a checksum remain; such keys are read meanwhile');
      if (!this.#stopped) this.#retryTimer = setTimeout(() => void this.read(), RETRY_MS);
      return;
    }
    if (changes !== this.#changes || !this.#listener.listening) return;
    this.#known = hashes.length > MAX_KNOWN ? undefined : new Set(hashes.map((hash) => hash.toString('base64')));
    // Logged when it changes: how many are known, or that there are too many to keep.
    const after = this.#known?.size ?? 'too many';
    if (after === this.#logged) return;
    this.#logged = after;
    if (after === 'too many') {
      this.#logger.info(
        { max: MAX_KNOWN },
        'more active keys without a checksum than a process keeps: every key of that form is read',
      );
    } else {
      this.#logger.info(
        { active: after },
        'active keys without a checksum known: other keys of that form are refused without a read',
      );
    }
  }
}
