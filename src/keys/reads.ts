// Reads of keys the cache does not hold, per API process, bounded and together (db/batcher.ts):
// the keys asked for while a read is under way share the next statement, up to MAX_BATCH keys in
// one and IN_FLIGHT statements under way at once (each holds one of the API pool's connections);
// WAITING keys more wait for their turn, first come first served. Beyond that a request is
// refused 503 service_unavailable with retry-after.
//
// A flood of keys that pass the checksum (computed by someone who read ids.ts, or of the length
// keys had before checksums while more of them are active than a process keeps: unchecksummed.ts)
// then costs a statement per group of keys, not per key, and holds a few of the pool's
// connections, not all of them: the rest serve the requests of keys the cache holds, which never
// come here. Why 503 and not 401: the key may be good, it was not looked at, and a client must not
// be told it is invalid (the client library does not retry a 401; it retries a 503 after its
// retry-after). Why not 429: that is a key's own rate; this is the process's load, whoever sends
// it.
import { Batcher } from '../db/batcher.ts';
import type { Db } from '../db/pool.ts';
import { serviceUnavailable } from '../errors.ts';
import { findKeysByHash, type KeyRecord } from './repository.ts';

/** Read statements under way at once: a few of the API pool's connections (DATABASE_POOL_SIZE, 10 by default). */
const IN_FLIGHT = 2;
/** Keys one statement reads at most, each a probe of the keys' unique index. */
const MAX_BATCH = 64;
/**
 * Keys waiting for a statement: four full ones. A statement of 64 keys takes a few milliseconds
 * while the database is well, so a full line is through in tens of milliseconds.
 */
const WAITING = 256;

export class KeyReads {
  readonly #reads: Batcher<Buffer, KeyRecord | undefined>;
  readonly #onRefused: (() => void) | undefined;

  /** `onRefused`: told of each request refused because the line is full. */
  constructor(db: Db, options: { onRefused?: () => void } = {}) {
    this.#reads = new Batcher((hashes) => findKeysByHash(db, hashes), { maxInFlight: IN_FLIGHT, maxBatch: MAX_BATCH });
    this.#onRefused = options.onRefused;
  }

  /** The key with this hash (undefined: none), or the 503 when the line is full. */
  read(keySha256: Buffer): Promise<KeyRecord | undefined> {
    if (this.#reads.waiting >= WAITING) {
      this.#onRefused?.();
      return Promise.reject(serviceUnavailable(1, 'The gateway is busy; try again in a moment.'));
    }
    return this.#reads.submit(keySha256);
  }
}
