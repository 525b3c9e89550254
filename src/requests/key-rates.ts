// RATE_LIMIT_RPS, LOOKUP_RATE_LIMIT_RPS and RATE_LIMIT_BYTES_PER_SECOND: a token bucket per API
// key and kind (submissions, lookups, body bytes), decided in the API process from its own state,
// which it brings in line with the other processes' in the background, so that a request costs
// no database round trip and the limit holds across processes approximately, lagging by one sync.
//
// Each bucket starts full. Every sync the process adds what it admitted to its counters in
// gateway.intake_counters and reads the sum of the other processes' counters for the keys it
// tracks, in one statement; what they admitted since the last read is taken from its bucket too,
// which may go below zero. So each process's bucket follows the one they would share, short of
// the others' admissions since its last sync. A key first seen is synchronised early, so that
// what the others admitted before the first read (taken as the starting point) is little.
// Buckets full and quiet for a while are forgotten, which bounds the memory to the keys in use.
// When the database cannot be reached, each process allows a key its whole rate by itself.
import { errorSummary, type Db } from '../db/pool.ts';
import { rateLimitExceeded, type ApiError } from '../errors.ts';
import type { Logger } from '../logger.ts';
import * as repository from './intake-repository.ts';
import type { IntakeKind } from './intake-repository.ts';
import { SyncLoop } from './sync-loop.ts';

/** Counters no process has added to for this long are deleted, by whichever process prunes next. */
const STALE_COUNTER_MS = 60_000;
const PRUNE_EVERY_MS = 10_000;

export interface Bucket {
  readonly keyId: string;
  /**
   * Tokens: one per admission (a byte of body per byte, for 'bytes'). Below zero when the other
   * processes admitted more than this one knew.
   */
  level: number;
  /** When `level` was last refilled (performance.now()). */
  at: number;
  /** Admitted here and not reported yet; and in the report under way. */
  unreported: number;
  reporting: number;
  /** The other processes' counters as last read; undefined until the first read. */
  others: number | undefined;
  /** The last admission here, or news of admissions elsewhere. */
  activeAt: number;
}

/** A limit of one kind: tokens added per second, and how many a full bucket holds. */
export interface KindLimit {
  perSecond: number;
  burst: number;
}

/** The token buckets of one kind of request, one per key. */
class RateLimit {
  readonly buckets = new Map<string, Bucket>();
  readonly kind: IntakeKind;
  readonly rate: number;
  readonly capacity: number;

  constructor(kind: IntakeKind, limit: KindLimit) {
    this.kind = kind;
    this.rate = limit.perSecond;
    this.capacity = limit.burst;
  }

  refill(bucket: Bucket, now: number): void {
    bucket.level = Math.min(this.capacity, bucket.level + (this.rate * (now - bucket.at)) / 1000);
    bucket.at = now;
  }

  /** Whole seconds until the bucket holds `cost` tokens again, at least 1. */
  retryAfter(bucket: Bucket, cost: number): number {
    return Math.max(1, Math.ceil((cost - bucket.level) / this.rate));
  }

  refusal(bucket: Bucket, cost: number): ApiError {
    const retryAfter = this.retryAfter(bucket, cost);
    const over = {
      submit: `its rate limit of ${this.rate} requests per second`,
      lookup: `its lookup rate limit of ${this.rate} lookups per second`,
      bytes: `its rate limit of ${this.rate} body bytes per second`,
    }[this.kind];
    return rateLimitExceeded(retryAfter, `This API key is over ${over}; retry after ${retryAfter} s.`);
  }
}

export interface KeyRatesOptions {
  /** This process's rows in gateway.intake_counters. */
  processId: string;
  syncMs: number;
  /** Buckets full and quiet for this long are forgotten. */
  idleMs: number;
  logger?: Logger | undefined;
}

export class KeyRates {
  readonly #db: Db;
  readonly #limits: Partial<Record<IntakeKind, RateLimit>>;
  readonly #processId: string;
  readonly #idleMs: number;
  readonly #logger: Logger | undefined;
  readonly #loop: SyncLoop;
  #prunedAt = -Infinity;
  /** Whether this process has counters in the table (it deletes them when it stops). */
  #reported = false;

  constructor(db: Db, limits: Partial<Record<IntakeKind, KindLimit | undefined>>, options: KeyRatesOptions) {
    this.#db = db;
    this.#limits = Object.fromEntries(
      Object.entries(limits).flatMap(([kind, limit]) => (limit === undefined ? [] : [[kind, new RateLimit(kind as IntakeKind, limit)]])),
    );
    this.#processId = options.processId;
    this.#idleMs = options.idleMs;
    this.#logger = options.logger;
    this.#loop = new SyncLoop(() => this.#syncOnce(), {
      syncMs: options.syncMs,
      logger: options.logger,
      logFields: { processId: options.processId },
    });
  }

  /** Buckets held (keys and kinds tracked). */
  get size(): number {
    return Object.values(this.#limits).reduce((size, limit) => size + limit.buckets.size, 0);
  }

  /**
   * The key's bucket of this kind, or the 429 when it holds fewer than `cost` tokens; undefined
   * when the kind is not limited. A cost above the bucket's capacity is asked for as the capacity.
   */
  check(kind: IntakeKind, keyId: string, cost = 1): Bucket | undefined {
    const limit = this.#limits[kind];
    if (!limit) return undefined;
    const now = performance.now();
    let bucket = limit.buckets.get(keyId);
    if (bucket) {
      limit.refill(bucket, now);
    } else {
      bucket = { keyId, level: limit.capacity, at: now, unreported: 0, reporting: 0, others: undefined, activeAt: now };
      limit.buckets.set(keyId, bucket);
      this.#loop.soon();
    }
    const needed = Math.min(cost, limit.capacity);
    if (bucket.level < needed) throw limit.refusal(bucket, needed);
    return bucket;
  }

  /** Takes the `cost` tokens check() found. */
  take(bucket: Bucket, cost = 1): void {
    bucket.level -= cost;
    bucket.unreported += cost;
    bucket.activeAt = performance.now();
  }

  start(): void {
    this.#loop.start();
  }

  sync(): Promise<void> {
    return this.#loop.sync();
  }

  /** Stops synchronising; waits for a sync under way, then deletes this process's counters (best effort). */
  async stop(): Promise<void> {
    await this.#loop.stop();
    if (!this.#reported) return;
    try {
      await repository.deleteIntakeCounters(this.#db, this.#processId);
      this.#reported = false;
    } catch (error) {
      this.#logger?.warn({ err: errorSummary(error), processId: this.#processId }, 'could not delete the intake counters of this process');
    }
  }

  async #syncOnce(): Promise<void> {
    const now = performance.now();
    const tracked: { limit: RateLimit; bucket: Bucket }[] = [];
    for (const limit of Object.values(this.#limits)) {
      for (const bucket of limit.buckets.values()) {
        limit.refill(bucket, now);
        if (bucket.unreported === 0 && bucket.level >= limit.capacity && now - bucket.activeAt > this.#idleMs) {
          limit.buckets.delete(bucket.keyId);
          continue;
        }
        bucket.reporting = bucket.unreported;
        bucket.unreported = 0;
        tracked.push({ limit, bucket });
      }
    }
    if (tracked.length === 0) return;

    let others: number[];
    try {
      others = await repository.addAdmittedAndReadOthers(
        this.#db,
        this.#processId,
        tracked.map(({ limit, bucket }) => ({ apiKeyId: bucket.keyId, kind: limit.kind, admitted: bucket.reporting })),
      );
    } catch (error) {
      for (const { bucket } of tracked) {
        bucket.unreported += bucket.reporting;
        bucket.reporting = 0;
      }
      this.#loop.failed('counters', error);
      return;
    }
    this.#loop.succeeded('counters');
    this.#reported = true;
    const readAt = performance.now();
    for (const [index, { limit, bucket }] of tracked.entries()) {
      bucket.reporting = 0;
      const total = others[index]!;
      const news = bucket.others === undefined ? 0 : total - bucket.others;
      // A drop (a process stopped, or stale counters deleted) is a new starting point, not news.
      bucket.others = total;
      if (news > 0) {
        limit.refill(bucket, readAt);
        bucket.level -= news;
        bucket.activeAt = readAt;
      }
    }

    if (now - this.#prunedAt >= PRUNE_EVERY_MS) {
      this.#prunedAt = now;
      try {
        await repository.deleteStaleIntakeCounters(this.#db, STALE_COUNTER_MS);
        this.#loop.succeeded('pruning');
      } catch (error) {
        this.#loop.failed('pruning', error);
      }
    }
  }
}
