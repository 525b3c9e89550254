// Keys and their signing secrets (decrypted, as ready HMAC keys), cached in the API process so that authenticating a
// request costs no database round trip. The database stays the truth: a key that changes
// (revoked, deleted) is announced by NOTIFY and dropped at once; while the LISTEN connection is
// down nothing is cached or served from the cache; and entries expire anyway after a minute.
// Requests that miss the same key at the same time (a cold cache under load, an entry just
// expired) share one read of it.
import type { KeyObject } from 'node:crypto';
import type { Listener } from '../db/listener.ts';
import type { Auth } from './service.ts';

export const KEYS_CHANNEL = 'gateway_api_keys_changed';

interface Entry {
  auth: Auth;
  keySha256: string;
  expiresAt: number;
  signingKey?: KeyObject;
}

export class KeyCache {
  readonly #byKeyId = new Map<string, Entry>();
  readonly #keyIdBySha = new Map<string, string>();
  readonly #listener: Listener;
  readonly #ttlMs: number;
  readonly #maxEntries: number;
  /**
   * Reads under way, by key hash (hex). An invalidation empties it: no later miss joins a read
   * begun before it, and such a read is not cached (the NOTIFY may have come while it was under
   * way), as it is no longer here when it ends.
   */
  readonly #reading = new Map<string, Promise<Auth | undefined>>();

  constructor(listener: Listener, options: { ttlMs?: number; maxEntries?: number } = {}) {
    this.#listener = listener;
    this.#ttlMs = options.ttlMs ?? 60_000;
    this.#maxEntries = options.maxEntries ?? 10_000;
    listener.subscribe(KEYS_CHANNEL, {
      notification: (keyId) => this.forget(keyId),
      lost: () => this.clear(),
      restored: () => this.clear(),
    });
  }

  get size(): number {
    return this.#byKeyId.size;
  }

  get(keySha256: Buffer): Auth | undefined {
    if (!this.#listener.listening) return undefined;
    const keyId = this.#keyIdBySha.get(keySha256.toString('hex'));
    const entry = keyId === undefined ? undefined : this.#byKeyId.get(keyId);
    if (!entry) return undefined;
    if (entry.expiresAt < Date.now()) {
      this.forget(entry.auth.keyId);
      return undefined;
    }
    return entry.auth;
  }

  #set(keySha256: Buffer, auth: Auth): void {
    if (!this.#listener.listening) return;
    if (this.#byKeyId.size >= this.#maxEntries) {
      // Maps keep insertion order: drop the oldest.
      const oldest = this.#byKeyId.values().next().value;
      if (oldest) {
        this.#byKeyId.delete(oldest.auth.keyId);
        this.#keyIdBySha.delete(oldest.keySha256);
      }
    }
    const sha = keySha256.toString('hex');
    this.#byKeyId.set(auth.keyId, { auth, keySha256: sha, expiresAt: Date.now() + this.#ttlMs });
    this.#keyIdBySha.set(sha, auth.keyId);
  }

  /**
   * The key read by `read` (undefined: no such key, or revoked) and cached, the one read shared
   * by the callers that miss it until it is done. A caller that comes after an invalidation
   * starts a read of its own: it must see the key as it is since then.
   */
  read(keySha256: Buffer, read: () => Promise<Auth | undefined>): Promise<Auth | undefined> {
    if (!this.#listener.listening) return read();
    const sha = keySha256.toString('hex');
    const shared = this.#reading.get(sha);
    if (shared) return shared;
    const reading: Promise<Auth | undefined> = read()
      .then((auth) => {
        if (auth && this.#reading.get(sha) === reading) this.#set(keySha256, auth);
        return auth;
      })
      .finally(() => {
        if (this.#reading.get(sha) === reading) this.#reading.delete(sha);
      });
    this.#reading.set(sha, reading);
    return reading;
  }

  /** The key's HMAC signing key, decrypted and prepared once per cache entry. */
  signingKey(auth: Auth, prepare: () => KeyObject): KeyObject {
    const entry = this.#listener.listening ? this.#byKeyId.get(auth.keyId) : undefined;
    if (!entry || entry.auth !== auth) return prepare();
    entry.signingKey ??= prepare();
    return entry.signingKey;
  }

  forget(keyId: string): void {
    this.#reading.clear();
    const entry = this.#byKeyId.get(keyId);
    if (!entry) return;
    this.#byKeyId.delete(keyId);
    this.#keyIdBySha.delete(entry.keySha256);
  }

  clear(): void {
    this.#reading.clear();
    this.#byKeyId.clear();
    this.#keyIdBySha.clear();
  }
}
