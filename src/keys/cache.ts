// Keys and their signing secrets (decrypted, as ready HMAC keys), cached in the API process so that authenticating a
// request costs no database round trip. The database stays the truth: a key that changes
// (revoked, deleted) is announced by NOTIFY and dropped at once; while the LISTEN connection is
// down nothing is cached or served from the cache; and entries expire anyway after a minute.
// Requests that miss the same key at the same time (a cold cache under load, an entry just
// expired, the LISTEN connection down) share one read of it: a process whose LISTEN connection
// is lost under load does not read a busy key once per request, nor refuse its requests for
// want of room among the bounded reads (reads.ts).
//
// Keys that are not there (unknown, revoked) are remembered too, for a few seconds, so that a
// client repeating a wrong key, or a flood of one, costs one read per few seconds rather than
// one per request. A key created meanwhile must work at once: its creation is announced on the
// same channel (sql/000011.sql), and any announcement forgets every miss, and keeps a read
// under way from remembering one.
import type { KeyObject } from 'node:crypto';
import { LRUCache } from 'lru-cache';
import type { Listener } from '../db/listener.ts';
import type { Auth } from './auth.ts';

export const KEYS_CHANNEL = 'gateway_api_keys_changed';
/** The payload's prefix for a key just created (sql/000011.sql); a bare key id: changed or deleted. */
export const CREATED = 'created:';

interface Entry {
  auth: Auth;
  signingKey?: KeyObject;
}

export class KeyCache {
  /**
   * Keys by their hash (hex), each for ttlMs after it was read; at most maxEntries, the least
   * recently used making room (lru-cache: bounds and expiry are its job, not ours).
   */
  readonly #bySha: LRUCache<string, Entry>;
  /** Which hash each cached key id is under, for a change announced by key id. */
  readonly #shaByKeyId = new Map<string, string>();
  /** Key hashes (hex) read and not found, each for missTtlMs; at most maxMisses. */
  readonly #misses: LRUCache<string, true>;
  /** Counts announcements: a read that saw one while under way remembers no miss. */
  #announcements = 0;
  readonly #listener: Listener;
  /**
   * Reads under way, by key hash (hex), each with the announcements counted when it began. An
   * invalidation empties it: no later miss joins a read begun before it, and such a read is not
   * cached (the NOTIFY may have come while it was under way), as it is no longer here when it
   * ends. After a creation, a miss joins no read begun before it either (that read may find no
   * key where there is one now): it starts its own, which takes the older one's place.
   */
  readonly #reading = new Map<string, { promise: Promise<Auth | undefined>; announcements: number }>();

  constructor(
    listener: Listener,
    options: { ttlMs?: number; maxEntries?: number; missTtlMs?: number; maxMisses?: number } = {},
  ) {
    this.#listener = listener;
    this.#bySha = new LRUCache<string, Entry>({
      max: options.maxEntries ?? 10_000,
      ttl: options.ttlMs ?? 60_000,
      // However an entry goes (expired, evicted, replaced, forgotten), its key id goes with it.
      dispose: (entry, sha) => {
        if (this.#shaByKeyId.get(entry.auth.keyId) === sha) this.#shaByKeyId.delete(entry.auth.keyId);
      },
    });
    this.#misses = new LRUCache<string, true>({ max: options.maxMisses ?? 10_000, ttl: options.missTtlMs ?? 5_000 });
    listener.subscribe(KEYS_CHANNEL, {
      // A creation can only turn a miss into a key: a read under way may still be cached.
      notification: (payload) => (payload.startsWith(CREATED) ? this.#forgetMisses() : this.forget(payload)),
      lost: () => this.clear(),
      restored: () => this.clear(),
    });
  }

  get size(): number {
    return this.#bySha.size;
  }

  /** How many key hashes are remembered as not found. */
  get misses(): number {
    return this.#misses.size;
  }

  /** true: this key hash was read and not found a moment ago (and nothing was announced since). */
  missed(keySha256: Buffer): boolean {
    return this.#listener.listening && this.#misses.get(keySha256.toString('hex')) === true;
  }

  #setMiss(sha: string): void {
    if (this.#listener.listening) this.#misses.set(sha, true);
  }

  get(keySha256: Buffer): Auth | undefined {
    if (!this.#listener.listening) return undefined;
    return this.#bySha.get(keySha256.toString('hex'))?.auth;
  }

  #set(keySha256: Buffer, auth: Auth): void {
    if (!this.#listener.listening) return;
    const sha = keySha256.toString('hex');
    this.#bySha.set(sha, { auth });
    this.#shaByKeyId.set(auth.keyId, sha);
  }

  /**
   * The key read by `read` (undefined: no such key, or revoked) and cached (a miss briefly: a key
   * missed a moment ago is not read again), the one read shared by the callers that miss it
   * until it is done. A caller that comes after an invalidation starts a read of its own: it must
   * see the key as it is since then. While the LISTEN connection is down the read is shared all
   * the same, and nothing is cached (#set and #setMiss keep nothing then); losing or regaining
   * the connection empties #reading, so no caller joins a read begun before either.
   */
  read(keySha256: Buffer, read: () => Promise<Auth | undefined>): Promise<Auth | undefined> {
    if (this.missed(keySha256)) return Promise.resolve(undefined);
    const sha = keySha256.toString('hex');
    const shared = this.#reading.get(sha);
    if (shared && shared.announcements === this.#announcements) return shared.promise;
    const reading = { announcements: this.#announcements } as { promise: Promise<Auth | undefined>; announcements: number };
    reading.promise = read()
      .then((auth) => {
        if (this.#reading.get(sha) === reading) {
          if (auth) this.#set(keySha256, auth);
          else if (reading.announcements === this.#announcements) this.#setMiss(sha);
        }
        return auth;
      })
      .finally(() => {
        if (this.#reading.get(sha) === reading) this.#reading.delete(sha);
      });
    this.#reading.set(sha, reading);
    return reading.promise;
  }

  /** The key's HMAC signing key, decrypted and prepared once per cache entry. */
  signingKey(auth: Auth, prepare: () => KeyObject): KeyObject {
    const sha = this.#listener.listening ? this.#shaByKeyId.get(auth.keyId) : undefined;
    const entry = sha === undefined ? undefined : this.#bySha.peek(sha);
    if (!entry || entry.auth !== auth) return prepare();
    entry.signingKey ??= prepare();
    return entry.signingKey;
  }

  /** A key was changed or deleted: forget it (and every miss, as a creation does). */
  forget(keyId: string): void {
    this.#reading.clear();
    this.#forgetMisses();
    const sha = this.#shaByKeyId.get(keyId);
    if (sha !== undefined) this.#bySha.delete(sha);
  }

  /** A key was created: it may be one that was missed, or one a read under way will miss. */
  #forgetMisses(): void {
    this.#announcements++;
    this.#misses.clear();
  }

  clear(): void {
    this.#reading.clear();
    this.#forgetMisses();
    this.#bySha.clear();
    this.#shaByKeyId.clear();
  }
}
