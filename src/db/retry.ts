// Riding out a database outage: a statement that failed because the database is unavailable
// is tried again, with backoff, until it succeeds, the time allowed is over, or the caller
// gives up. A caller may also have a statement that lost a conflict to another transaction
// tried again (`conflicts`): Postgres rolled it back, and the same statement mostly succeeds next.
import { setTimeout as sleep } from 'node:timers/promises';
import { Backoff } from '../client/backoff.ts';
import type { Logger } from '../logger.ts';
import { errorSummary, isConflict, isDatabaseUnavailable } from './pool.ts';

export interface RetryOptions {
  /** Give up (rethrow) once this much time has passed; unset: however long it takes. */
  maxWaitMs?: number;
  /** Give up (rethrow the last failure) once this is aborted, ending a wait under way at once. */
  signal?: AbortSignal;
  /**
   * Where the retries are logged, with `message` and `fields`: the first as a warning, the others
   * at debug level (a long outage would otherwise log every statement waiting on it every 2 s).
   */
  log: { logger: Logger; message: string; fields?: Record<string, unknown> };
  /**
   * Tries again, this many times at most, a statement that failed as a deadlock's victim or a
   * serialization failure (isConflict), logged as a warning each time; unset: those are rethrown.
   * Only for a `run` that is a whole transaction, as Postgres rolled it back.
   */
  conflicts?: number;
}

/** How many times a caller has a statement that lost a conflict run again (`conflicts`), as a rule. */
export const CONFLICT_RETRIES = 5;

/** The longest wait between two tries. */
const MAX_RETRY_DELAY_MS = 2_000;

export async function whileUnavailable<T>(run: () => Promise<T>, options: RetryOptions): Promise<T> {
  const deadline = Date.now() + (options.maxWaitMs ?? Infinity);
  const backoff = new Backoff(100, MAX_RETRY_DELAY_MS);
  let conflicts = 0;
  for (let retries = 1; ; retries++) {
    try {
      return await run();
    } catch (error) {
      const delay = backoff.next();
      const conflict = isConflict(error) && conflicts++ < (options.conflicts ?? 0);
      if (!(conflict || isDatabaseUnavailable(error)) || Date.now() + delay > deadline || options.signal?.aborted) throw error;
      const fields = { ...options.log.fields, err: errorSummary(error), delayMs: delay, retries };
      if (conflict) options.log.logger.warn(fields, 'statement lost a conflict with another transaction; trying it again');
      else if (retries === 1) options.log.logger.warn(fields, options.log.message);
      else options.log.logger.debug(fields, options.log.message);
      await sleep(delay, undefined, options.signal ? { signal: options.signal } : {}).catch(() => {});
      if (options.signal?.aborted) throw error;
    }
  }
}
