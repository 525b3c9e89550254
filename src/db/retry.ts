// Riding out a database outage: a statement that failed because the database is unavailable
// is tried again, with backoff, until it succeeds, the time allowed is over, or the caller
// gives up.
import { setTimeout as sleep } from 'node:timers/promises';
import { Backoff } from '../backoff.ts';
import { isDatabaseUnavailable } from './pool.ts';

export interface RetryOptions {
  /** Give up (rethrow) once this much time has passed; unset: however long it takes. */
  maxWaitMs?: number;
  /** Give up (rethrow the last failure) once this is aborted, ending a wait under way at once. */
  signal?: AbortSignal;
  /** Told of each retry: the failure, the wait before it, and how many retries so far (1 first). */
  onRetry?: (error: unknown, delayMs: number, retries: number) => void;
}

/** The longest wait between two tries. */
const MAX_RETRY_DELAY_MS = 2_000;

export async function whileUnavailable<T>(run: () => Promise<T>, options: RetryOptions): Promise<T> {
  const deadline = Date.now() + (options.maxWaitMs ?? Infinity);
  const backoff = new Backoff(100, MAX_RETRY_DELAY_MS);
  for (let retries = 1; ; retries++) {
    try {
      return await run();
    } catch (error) {
      const delay = backoff.next();
      if (!isDatabaseUnavailable(error) || Date.now() + delay > deadline || options.signal?.aborted) throw error;
      options.onRetry?.(error, delay, retries);
      await sleep(delay, undefined, options.signal ? { signal: options.signal } : {}).catch(() => {});
      if (options.signal?.aborted) throw error;
    }
  }
}
