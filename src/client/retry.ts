// When to try a call again, and how long to wait first.
import { doubling, jitter } from './backoff.ts';
import { APIUserAbortError } from './errors.ts';
import { MAX_WAIT_MS } from './request.ts';

/** A retry-after longer than this is not waited out: the error is thrown instead. */
export const MAX_RETRY_AFTER_MS = 60_000;

const INITIAL_BACKOFF_MS = 500;
const MAX_BACKOFF_MS = 8_000;

/**
 * 409 codes that state how a request ended: asking again gets the same answer, so they are
 * thrown at once although other 409s (lock timeouts, say) are retried.
 */
const FINAL_CONFLICT_CODES: ReadonlySet<string> = new Set(['request_already_finished']);

/**
 * 408 and 409 (lock and request timeouts), 429 and every 5xx; other 4xx would fail again, and
 * so would a 409 whose `code` (from the error body, null without one) is final.
 */
export function isRetryableAnswer(status: number, code: string | null): boolean {
  if (status === 409) return code === null || !FINAL_CONFLICT_CODES.has(code);
  return status === 408 || status === 429 || status >= 500;
}

/**
 * Exponential backoff with jitter for the retry after `failures` failed attempts (1, 2, ...):
 * 500 ms doubling up to 8 s, less up to a quarter at random so clients that failed together
 * do not come back together.
 */
export function backoffMs(failures: number): number {
  return jitter(doubling(failures, INITIAL_BACKOFF_MS, MAX_BACKOFF_MS), 0.25);
}

/**
 * The wait the server asked for, in milliseconds: `retry-after-ms`, else `retry-after` in seconds
 * or as an HTTP date. Undefined when neither header is there or readable.
 */
export function retryAfterMs(headers: Headers, now = Date.now()): number | undefined {
  const milliseconds = headers.get('retry-after-ms');
  if (milliseconds !== null && /^\s*\d+(\.\d+)?\s*$/.test(milliseconds)) return Number(milliseconds);
  return parseRetryAfter(headers.get('retry-after'), now);
}

/**
 * A `retry-after` value, in seconds or as an HTTP date, in whole milliseconds (0 for a date
 * already past). Undefined when there is none, or it is blank, negative or unreadable. The
 * gateway reads its upstreams' and webhook endpoints' answers with it too.
 */
export function parseRetryAfter(value: string | null, now = Date.now()): number | undefined {
  if (value === null || value.trim() === '') return undefined;
  const seconds = Number(value);
  if (Number.isFinite(seconds)) return seconds >= 0 ? Math.round(seconds * 1000) : undefined;
  const date = Date.parse(value);
  return Number.isNaN(date) ? undefined : Math.max(0, date - now);
}

/**
 * The timer of sleep(), the pauses between retries and between polls. Not exported from the
 * package (index.ts): the library's tests put a stand-in here that records the pauses asked for,
 * and ends them at once or when they choose, rather than timing the machine.
 */
export const pauseTimer: { set(fire: () => void, ms: number): unknown; clear(timer: unknown): void } = {
  set: (fire, ms) => setTimeout(fire, ms),
  clear: (timer) => clearTimeout(timer as ReturnType<typeof setTimeout>),
};

/**
 * Resolves after `ms`, or rejects with APIUserAbortError as soon as `signal` fires. `ms` is at
 * most MAX_WAIT_MS (the options that set a wait are checked against it), as a timer fires a
 * longer wait, or NaN, after 1 ms; such a wait is a RangeError rather than no wait at all.
 */
export function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve, reject) => {
    if (!(ms >= 0 && ms <= MAX_WAIT_MS)) return reject(new RangeError(`A wait of ${ms} ms is not from 0 to ${MAX_WAIT_MS}.`));
    if (signal?.aborted) return reject(new APIUserAbortError({ cause: signal.reason }));
    const timer = pauseTimer.set(done, ms);
    signal?.addEventListener('abort', aborted, { once: true });
    function done() {
      signal?.removeEventListener('abort', aborted);
      resolve();
    }
    function aborted() {
      pauseTimer.clear(timer);
      reject(new APIUserAbortError({ cause: signal?.reason }));
    }
  });
}
