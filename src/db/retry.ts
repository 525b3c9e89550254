// Riding out a database outage: a statement that failed because the database is unreachable
// is tried again, with backoff, until it succeeds or the time allowed is over.
import { isDatabaseUnavailable } from './pool.ts';

export interface RetryOptions {
  /** Give up (rethrow) once this much time has passed. */
  maxWaitMs: number;
  onRetry?: (error: unknown, delayMs: number) => void;
}

export async function whileUnavailable<T>(run: () => Promise<T>, options: RetryOptions): Promise<T> {
  const deadline = Date.now() + options.maxWaitMs;
  for (let delay = 100; ; delay = Math.min(delay * 2, 2_000)) {
    try {
      return await run();
    } catch (error) {
      if (!isDatabaseUnavailable(error) || Date.now() + delay > deadline) throw error;
      options.onRetry?.(error, delay);
      await new Promise((resolve) => setTimeout(resolve, delay));
    }
  }
}
