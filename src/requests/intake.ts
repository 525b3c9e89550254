// Intake limits (docs/lanes.md, "Intake limits"): RATE_LIMIT_RPS and RATE_LIMIT_BYTES_PER_SECOND
// per API key (lookups apart, with their own limit: key-rates.ts) and MAX_UNFINISHED_PER_PROJECT
// (unfinished-counts.ts). Beyond any, a 429 with retry-after, and nothing stored. Each limit is
// decided in the API process from its own state, synchronised with the other processes' in the
// background. A submission is checked twice: before its body is read (checkSubmission, with the
// size its Content-Length announces), so that a refused one costs no reading nor parsing, and
// once it is valid (admitSubmission), which counts it.
import { hostname } from 'node:os';
import type { Config } from '../config.ts';
import type { Db } from '../db/pool.ts';
import type { ApiError } from '../errors.ts';
import { randomBase62, type KeyMode } from '../ids.ts';
import type { Auth } from '../keys/auth.ts';
import type { Logger } from '../logger.ts';
import { KeyRates, type KindLimit } from './key-rates.ts';
import { UnfinishedCounts } from './unfinished-counts.ts';

export interface Intake {
  /**
   * Throws (or rejects with) the 429 that admitSubmission would for a body of `bodyBytes` (what
   * Content-Length announces; 0 when it is not known yet), and counts nothing. It waits, when it
   * returns a promise, for the first count of a project this process does not know yet.
   */
  checkSubmission(auth: Auth, bodyBytes: number): void | Promise<void>;
  /**
   * Throws the 429 when the key is over its rate or its byte rate, or its project and mode has
   * too many unfinished requests; else counts the submission and its body's bytes, and the
   * request `requestId` as unfinished until it is stored and counted.
   */
  admitSubmission(auth: Auth, bodyBytes: number, requestId: string): void;
  /** The admitted request `requestId` stored nothing of its own (refused later, replayed, or failed). */
  withdraw(auth: Auth, requestId: string): void;
  /** Throws the 429 when the key is over its lookup rate. */
  admitLookup(auth: Auth): void;
}

/** The intake of a gateway that sets no limit: everything is admitted. */
export const NO_INTAKE_LIMITS: Intake = Object.freeze({
  checkSubmission: () => {},
  admitSubmission: () => {},
  withdraw: () => {},
  admitLookup: () => {},
});

export type IntakeLimit = 'rate' | 'lookup_rate' | 'bytes_rate' | 'unfinished';

export type IntakeConfig = Pick<
  Config,
  'rateLimitRps' | 'lookupRateLimitRps' | 'rateLimitBytesPerSecond' | 'maxUnfinishedPerProject' | 'maxBodyBytes'
>;

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
    config.rateLimitBytesPerSecond === undefined &&
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
    const perSecond = (rate: number | undefined, burst: number): KindLimit | undefined =>
      rate === undefined ? undefined : { perSecond: rate, burst };
    const limits = {
      submit: perSecond(config.rateLimitRps, 2 * (config.rateLimitRps ?? 0)),
      lookup: perSecond(config.lookupRateLimitRps, 2 * (config.lookupRateLimitRps ?? 0)),
      // A burst of two seconds' worth, and at least one body of the largest size allowed.
      bytes: perSecond(config.rateLimitBytesPerSecond, Math.max(2 * (config.rateLimitBytesPerSecond ?? 0), config.maxBodyBytes)),
    };
    this.#rates = Object.values(limits).some((limit) => limit !== undefined)
      ? new KeyRates(db, limits, { ...shared, processId: this.processId })
      : undefined;
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

  checkSubmission(auth: Auth, bodyBytes: number): void | Promise<void> {
    const { project } = this.#checkSubmission(auth, bodyBytes);
    // Checked again once its project is counted: a refusal of the rates needs no count.
    const counted = project && this.#unfinished!.counted(project);
    if (counted) return counted.then(() => void this.#checkSubmission(auth, bodyBytes));
  }

  admitSubmission(auth: Auth, bodyBytes: number, requestId: string): void {
    // All checked before any is counted: a request one limit refuses costs nothing of the others.
    const { requests, bytes, project } = this.#checkSubmission(auth, bodyBytes);
    if (requests) this.#rates!.take(requests);
    if (bytes) this.#rates!.take(bytes, bodyBytes);
    if (project) this.#unfinished!.take(project, requestId);
  }

  withdraw(auth: Auth, requestId: string): void {
    // The rates stay spent: the submission was made.
    this.#unfinished?.withdraw(auth, requestId);
  }

  #checkSubmission(auth: Auth, bodyBytes: number) {
    const rates = this.#rates;
    const unfinished = this.#unfinished;
    return {
      requests: rates && this.#refusing(auth.mode, 'rate', () => rates.check('submit', auth.keyId)),
      bytes: rates && bodyBytes > 0 ? this.#refusing(auth.mode, 'bytes_rate', () => rates.check('bytes', auth.keyId, bodyBytes)) : undefined,
      project: unfinished && this.#refusing(auth.mode, 'unfinished', () => unfinished.check(auth)),
    };
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
