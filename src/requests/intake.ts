// Intake limits (docs/lanes.md, "Intake limits"): RATE_LIMIT_RPS per API key (lookups apart,
// with their own limit) and MAX_UNFINISHED_PER_PROJECT. Beyond either, a 429 with retry-after,
// and nothing stored.
import { hostname } from 'node:os';
import type { Config } from '../config.ts';
import { errorSummary, type Db } from '../db/pool.ts';
import { rateLimitExceeded, type ApiError } from '../errors.ts';
import { randomBase62, type KeyMode } from '../ids.ts';
import type { Auth } from '../keys/auth.ts';
import type { Logger } from '../logger.ts';
import * as repository from './intake-repository.ts';
import type { IntakeKind } from './intake-repository.ts';

export interface Intake {
  /** Throws the 429 when the key is over its rate, or its project and mode has too many unfinished requests. */
  admitSubmission(auth: Auth): void;
  /** Throws the 429 when the key is over its lookup rate. */
  admitLookup(auth: Auth): void;
}

export type IntakeLimit = 'rate' | 'lookup_rate' | 'unfinished';

export type IntakeConfig = Pick<Config, 'rateLimitRps' | 'lookupRateLimitRps' | 'maxUnfinishedPerProject'>;

export interface IntakeOptions {
  logger?: Logger | undefined;
  /** How often the process reports its admissions and reads the others' (ms). */
  syncMs?: number | undefined;
  /** Told of every refusal, by the key's mode and the limit that refused it. */
  onRefused?: ((mode: KeyMode, limit: IntakeLimit) => void) | undefined;
}

const DEFAULT_SYNC_MS = 100;
/** A key or project that has seen nothing for this many syncs (5 s by default) is forgotten. */
const IDLE_SYNCS = 50;
/** A key or project seen for the first time is synchronised early: this fraction of a sync after the last one. */
const EARLY_SYNC = 0.1;
/** Counters no process has added to for this long are deleted, by whichever process prunes next. */
const STALE_COUNTER_MS = 60_000;
const PRUNE_EVERY_MS = 10_000;

/** The intake limits `config` sets, or undefined when it sets none: then nothing is checked. */
export function intakeLimitsFor(db: Db, config: IntakeConfig, options: IntakeOptions = {}): IntakeLimits | undefined {
  if (
    config.rateLimitRps === undefined &&
    config.lookupRateLimitRps === undefined &&
    config.maxUnfinishedPerProject === undefined
  ) {
    return undefined;
  }
  return new IntakeLimits(db, config, options);
}

interface Bucket {
  readonly keyId: string;
  /** Tokens: one per admission. Below zero when the other processes admitted more than this one knew. */
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

/** The token buckets of one kind of request, one per key: rate per second, capacity twice that. */
class RateLimit {
  readonly buckets = new Map<string, Bucket>();
  readonly kind: IntakeKind;
  readonly limit: IntakeLimit;
  readonly rate: number;
  readonly capacity: number;

  constructor(kind: IntakeKind, rate: number) {
    this.kind = kind;
    this.limit = kind === 'submit' ? 'rate' : 'lookup_rate';
    this.rate = rate;
    this.capacity = 2 * rate;
  }

  refill(bucket: Bucket, now: number): void {
    bucket.level = Math.min(this.capacity, bucket.level + (this.rate * (now - bucket.at)) / 1000);
    bucket.at = now;
  }

  /** Whole seconds until the bucket holds a token again, at least 1. */
  retryAfter(bucket: Bucket): number {
    return Math.max(1, Math.ceil((1 - bucket.level) / this.rate));
  }

  refusal(bucket: Bucket): ApiError {
    const retryAfter = this.retryAfter(bucket);
    return rateLimitExceeded(
      retryAfter,
      this.kind === 'submit'
        ? `This API key is over its rate limit of ${this.rate} requests per second; retry after ${retryAfter} s.`
        : `This API key is over its lookup rate limit of ${this.rate} lookups per second; retry after ${retryAfter} s.`,
    );
  }
}

interface ProjectCount {
  readonly projectId: string;
  readonly mode: KeyMode;
  /** Its unfinished requests as last counted (at most the limit + 1); undefined until counted once. */
  counted: number | undefined;
  /** Admitted here since the last count began. */
  admitted: number;
  /** The last submission seen (admitted or not). */
  activeAt: number;
}

/**
 * The intake limits, decided in the API process from its own state, which it brings in line with
 * the other processes' in the background: a request costs no database round trip, and the limits
 * hold across processes approximately, lagging by one sync.
 *
 * Rates: a token bucket per key and kind (submissions, lookups), starting full. Every sync the
 * process adds what it admitted to its counters in gateway.intake_counters and reads the sum of
 * the other processes' counters for the keys it tracks, in one statement; what they admitted
 * since the last read is taken from its bucket too, which may go below zero. So each process's
 * bucket follows the one they would share, short of the others' admissions since its last sync.
 * A key first seen is synchronised early, so that what the others admitted before the first
 * read (taken as the starting point) is little. Buckets full and quiet for IDLE_SYNCS syncs are
 * forgotten, which bounds the memory to the keys in use.
 *
 * Unfinished requests: per project and mode seen lately, the count as of the last sync plus
 * what this process admitted since (one statement for all of them, each count stopping at the
 * limit + 1). A project first seen is admitted until its first count arrives, moments later
 * (it is synchronised early too).
 *
 * When the database cannot be reached, decisions go on from local state: each process then
 * allows a key its whole rate by itself, and counts only its own admissions against projects.
 */
export class IntakeLimits implements Intake {
  /** This process's rows in gateway.intake_counters: random per start. */
  readonly processId = `api-${hostname()}-${process.pid}-${randomBase62(8)}`;
  readonly #db: Db;
  readonly #submits: RateLimit | undefined;
  readonly #lookups: RateLimit | undefined;
  readonly #maxUnfinished: number | undefined;
  readonly #projects = new Map<string, ProjectCount>();
  readonly #logger: Logger | undefined;
  readonly #onRefused: ((mode: KeyMode, limit: IntakeLimit) => void) | undefined;
  readonly #syncMs: number;
  readonly #idleMs: number;

  #started = false;
  #stopped = false;
  #timer: NodeJS.Timeout | undefined;
  /** A key or project was seen for the first time since the last sync began. */
  #soon = false;
  #syncing: Promise<void> | undefined;
  #lastSyncAt = -Infinity;
  #prunedAt = -Infinity;
  /** Whether this process has counters in the table (it deletes them when it stops). */
  #reported = false;
  /** The parts of the sync failing now: each is logged as a warning when it starts failing. */
  readonly #failing = new Set<string>();

  constructor(db: Db, config: IntakeConfig, options: IntakeOptions = {}) {
    this.#db = db;
    this.#submits = config.rateLimitRps === undefined ? undefined : new RateLimit('submit', config.rateLimitRps);
    this.#lookups = config.lookupRateLimitRps === undefined ? undefined : new RateLimit('lookup', config.lookupRateLimitRps);
    this.#maxUnfinished = config.maxUnfinishedPerProject;
    this.#logger = options.logger;
    this.#onRefused = options.onRefused;
    this.#syncMs = options.syncMs ?? DEFAULT_SYNC_MS;
    this.#idleMs = IDLE_SYNCS * this.#syncMs;
  }

  /** Keys (per kind) and projects (per mode) this process is tracking. */
  get size(): number {
    return (this.#submits?.buckets.size ?? 0) + (this.#lookups?.buckets.size ?? 0) + this.#projects.size;
  }

  admitSubmission(auth: Auth): void {
    const now = performance.now();
    const rate = this.#submits;
    const bucket = rate && this.#bucket(rate, auth.keyId, now);
    if (rate && bucket && bucket.level < 1) this.#refuse(auth.mode, rate.limit, rate.refusal(bucket));
    const max = this.#maxUnfinished;
    const project = max === undefined ? undefined : this.#project(auth, now);
    if (max !== undefined && project && (project.counted ?? 0) + project.admitted >= max) {
      this.#refuse(
        auth.mode,
        'unfinished',
        rateLimitExceeded(
          1,
          `This project has ${max} ${auth.mode} requests not yet finished, its limit (MAX_UNFINISHED_PER_PROJECT); retry after 1 s.`,
        ),
      );
    }
    if (bucket) this.#take(bucket, now);
    if (project) project.admitted++;
  }

  admitLookup(auth: Auth): void {
    const rate = this.#lookups;
    if (!rate) return;
    const now = performance.now();
    const bucket = this.#bucket(rate, auth.keyId, now);
    if (bucket.level < 1) this.#refuse(auth.mode, rate.limit, rate.refusal(bucket));
    this.#take(bucket, now);
  }

  /** Synchronises every `syncMs` from now on. */
  start(): void {
    if (this.#started || this.#stopped) return;
    this.#started = true;
    this.#schedule();
  }

  /** Stops synchronising; waits for a sync under way, then deletes this process's counters (best effort). */
  async stop(): Promise<void> {
    this.#stopped = true;
    clearTimeout(this.#timer);
    this.#timer = undefined;
    while (this.#syncing) await this.#syncing;
    if (!this.#reported) return;
    try {
      await repository.deleteIntakeCounters(this.#db, this.processId);
      this.#reported = false;
    } catch (error) {
      this.#logger?.warn({ err: errorSummary(error), processId: this.processId }, 'could not delete the intake counters of this process');
    }
  }

  /**
   * Reports this process's admissions and reads the others', and counts the unfinished requests
   * of the projects seen lately; after the sync under way, if any. Never rejects: a failure
   * leaves the local state to decide on.
   */
  async sync(): Promise<void> {
    while (this.#syncing) await this.#syncing;
    const syncing = this.#syncOnce().finally(() => {
      this.#syncing = undefined;
    });
    this.#syncing = syncing;
    await syncing;
    if (this.#started) this.#schedule();
  }

  #bucket(rate: RateLimit, keyId: string, now: number): Bucket {
    let bucket = rate.buckets.get(keyId);
    if (bucket) {
      rate.refill(bucket, now);
    } else {
      bucket = { keyId, level: rate.capacity, at: now, unreported: 0, reporting: 0, others: undefined, activeAt: now };
      rate.buckets.set(keyId, bucket);
      this.#syncSoon();
    }
    return bucket;
  }

  #take(bucket: Bucket, now: number): void {
    bucket.level -= 1;
    bucket.unreported++;
    bucket.activeAt = now;
  }

  #project(auth: Auth, now: number): ProjectCount {
    const key = `${auth.mode} ${auth.projectId}`;
    let project = this.#projects.get(key);
    if (!project) {
      project = { projectId: auth.projectId, mode: auth.mode, counted: undefined, admitted: 0, activeAt: now };
      this.#projects.set(key, project);
      this.#syncSoon();
    }
    project.activeAt = now;
    return project;
  }

  #refuse(mode: KeyMode, limit: IntakeLimit, error: ApiError): never {
    this.#onRefused?.(mode, limit);
    throw error;
  }

  #schedule(): void {
    if (this.#stopped) return;
    clearTimeout(this.#timer);
    const delay = this.#lastSyncAt + (this.#soon ? EARLY_SYNC : 1) * this.#syncMs - performance.now();
    this.#timer = setTimeout(() => this.#tick(), Math.max(0, delay)).unref();
  }

  #syncSoon(): void {
    if (!this.#started || this.#stopped || this.#soon) return;
    this.#soon = true;
    // A sync under way schedules the next when it ends.
    if (!this.#syncing) this.#schedule();
  }

  #tick(): void {
    this.#timer = undefined;
    this.#soon = false;
    // sync() never rejects, and schedules the next; stop() waits for it.
    void this.sync();
  }

  async #syncOnce(): Promise<void> {
    const now = performance.now();
    this.#lastSyncAt = now;
    await Promise.all([this.#syncRates(now), this.#countUnfinished(now)]);
  }

  async #syncRates(now: number): Promise<void> {
    const tracked: { rate: RateLimit; bucket: Bucket }[] = [];
    for (const rate of [this.#submits, this.#lookups]) {
      if (!rate) continue;
      for (const bucket of rate.buckets.values()) {
        rate.refill(bucket, now);
        if (bucket.unreported === 0 && bucket.level >= rate.capacity && now - bucket.activeAt > this.#idleMs) {
          rate.buckets.delete(bucket.keyId);
          continue;
        }
        bucket.reporting = bucket.unreported;
        bucket.unreported = 0;
        tracked.push({ rate, bucket });
      }
    }
    if (tracked.length === 0) return;

    let others: number[];
    try {
      others = await repository.addAdmittedAndReadOthers(
        this.#db,
        this.processId,
        tracked.map(({ rate, bucket }) => ({ apiKeyId: bucket.keyId, kind: rate.kind, admitted: bucket.reporting })),
      );
    } catch (error) {
      for (const { bucket } of tracked) {
        bucket.unreported += bucket.reporting;
        bucket.reporting = 0;
      }
      this.#failed('counters', error);
      return;
    }
    this.#succeeded('counters');
    this.#reported = true;
    const readAt = performance.now();
    for (const [index, { rate, bucket }] of tracked.entries()) {
      bucket.reporting = 0;
      const total = others[index]!;
      const news = bucket.others === undefined ? 0 : total - bucket.others;
      // A drop (a process stopped, or stale counters deleted) is a new starting point, not news.
      bucket.others = total;
      if (news > 0) {
        rate.refill(bucket, readAt);
        bucket.level -= news;
        bucket.activeAt = readAt;
      }
    }

    if (now - this.#prunedAt >= PRUNE_EVERY_MS) {
      this.#prunedAt = now;
      try {
        await repository.deleteStaleIntakeCounters(this.#db, STALE_COUNTER_MS);
        this.#succeeded('pruning');
      } catch (error) {
        this.#failed('pruning', error);
      }
    }
  }

  async #countUnfinished(now: number): Promise<void> {
    const max = this.#maxUnfinished;
    if (max === undefined) return;
    const counting: { project: ProjectCount; admitted: number }[] = [];
    for (const [key, project] of this.#projects) {
      if (now - project.activeAt > this.#idleMs) {
        this.#projects.delete(key);
        continue;
      }
      counting.push({ project, admitted: 0 });
    }
    if (counting.length === 0) return;

    let counts: number[];
    try {
      counts = await this.#db.connection().execute((connection) => {
        // Read once the connection is held, as the statement leaves: a request admitted later
        // is stored later still, so it cannot be in the count and stays added on. Read before
        // waiting for a connection, the requests admitted and stored during the wait would be
        // both in the count and added on, and refuse a project below its limit.
        for (const entry of counting) entry.admitted = entry.project.admitted;
        return repository.countUnfinished(
          connection,
          counting.map(({ project }) => project),
          max + 1,
        );
      });
    } catch (error) {
      this.#failed('unfinished', error);
      return;
    }
    this.#succeeded('unfinished');
    for (const [index, { project, admitted }] of counting.entries()) {
      // What was admitted before the statement left and is not stored yet is missing from the
      // count until the next one: a project may go over its limit by that much, for one sync.
      project.counted = counts[index]!;
      project.admitted -= admitted;
    }
  }

  #failed(part: string, error: unknown): void {
    const fields = { err: errorSummary(error), processId: this.processId, part };
    if (this.#failing.has(part)) {
      this.#logger?.debug(fields, 'intake limits still not synchronised');
      return;
    }
    this.#failing.add(part);
    this.#logger?.warn(fields, 'could not synchronise the intake limits; deciding on this process\'s own counts meanwhile');
  }

  #succeeded(part: string): void {
    if (this.#failing.delete(part)) this.#logger?.info({ processId: this.processId, part }, 'intake limits synchronised again');
  }
}
