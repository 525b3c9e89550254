// Intake limits (docs/lanes.md, "Intake limits"): RATE_LIMIT_RPS per API key (lookups apart,
// with their own limit: key-rates.ts) and MAX_UNFINISHED_PER_PROJECT (unfinished-counts.ts).
// Beyond either, a 429 with retry-after, and nothing stored. Each limit is decided in the API
// process from its own state, synchronised with the other processes' in the background.
import { hostname } from 'node:os';
import type { Config } from '../config.ts';
import type { Db } from '../db/pool.ts';
import type { ApiError } from '../errors.ts';
import { randomBase62, type KeyMode } from '../ids.ts';
import type { Auth } from '../keys/auth.ts';
import type { Logger } from '../logger.ts';
import { KeyRates } from './key-rates.ts';
import { UnfinishedCounts } from './unfinished-counts.ts';

export interface Intake {
  /** Throws the 429 when the key is over its rate, or its project and mode has too many unfinished requests. */
  admitSubmission(auth: Auth): void;
  /** Throws the 429 when the key is over its lookup rate. */
  admitLookup(auth: Auth): void;
}

/** The intake of a gateway that sets no limit: everything is admitted. */
export const NO_INTAKE_LIMITS: Intake = Object.freeze({
  admitSubmission: () => {},
  admitLookup: () => {},
});

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

/** The limits `config` sets, each synchronised on its own. */
export class IntakeLimits implements Intake {
  /** This process's rows in gateway.intake_counters: random per start. */
  readonly processId = `api-${hostname()}-${process.pid}-${randomBase62(8)}`;
  readonly #rates: KeyRates | undefined;
  readonly #unfinished: UnfinishedCounts | undefined;
  readonly #onRefused: ((mode: KeyMode, limit: IntakeLimit) => void) | undefined;

  constructor(db: Db, config: IntakeConfig, options: IntakeOptions = {}) {
    const syncMs = options.syncMs ?? DEFAULT_SYNC_MS;
    const shared = { syncMs, idleMs: IDLE_SYNCS * syncMs, logger: options.logger };
    this.#rates =
      config.rateLimitRps === undefined && config.lookupRateLimitRps === undefined
        ? undefined
        : new KeyRates(db, { submit: config.rateLimitRps, lookup: config.lookupRateLimitRps }, { ...shared, processId: this.processId });
    this.#unfinished =
      config.maxUnfinishedPerProject === undefined
        ? undefined
        : new UnfinishedCounts(db, config.maxUnfinishedPerProject, { ...shared, logFields: { processId: this.processId } });
    this.#onRefused = options.onRefused;
  }

  /** Keys (per kind) and projects (per mode) this process is tracking. */
  get size(): number {
    return (this.#rates?.size ?? 0) + (this.#unfinished?.size ?? 0);
  }

  admitSubmission(auth: Auth): void {
    // Both checked before either is counted: a request one limit refuses costs nothing of the other.
    const rates = this.#rates;
    const unfinished = this.#unfinished;
    const bucket = rates && this.#refusing(auth.mode, 'rate', () => rates.check('submit', auth.keyId));
    const project = unfinished && this.#refusing(auth.mode, 'unfinished', () => unfinished.check(auth));
    if (bucket) rates!.take(bucket);
    if (project) unfinished!.take(project);
  }

  admitLookup(auth: Auth): void {
    const rates = this.#rates;
    const bucket = rates && this.#refusing(auth.mode, 'lookup_rate', () => rates.check('lookup', auth.keyId));
    if (bucket) rates!.take(bucket);
  }

  /** Synchronises every `syncMs` from now on. */
  start(): void {
    this.#rates?.start();
    this.#unfinished?.start();
  }

  /** Stops synchronising; waits for syncs under way, then deletes this process's counters (best effort). */
  async stop(): Promise<void> {
    await Promise.all([this.#rates?.stop(), this.#unfinished?.stop()]);
  }

  /** Synchronises every limit now (after a sync under way). Never rejects: a failure leaves local state to decide on. */
  async sync(): Promise<void> {
    await Promise.all([this.#rates?.sync(), this.#unfinished?.sync()]);
  }

  #refusing<T>(mode: KeyMode, limit: IntakeLimit, check: () => T): T {
    try {
      return check();
    } catch (error) {
      this.#onRefused?.(mode, limit);
      throw error as ApiError;
    }
  }
}
