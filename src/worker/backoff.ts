// Exponential backoff with full jitter: the n-th retry waits a uniformly random time in
// [0, min(max, base * 2^(n-1))], so clients that failed together do not retry together.

// A retry-after longer than this is not honoured in full: a request must not sleep for days,
// nor a lane stay paused for them.
export const MAX_RETRY_AFTER_MS = 60 * 60 * 1000;

export interface BackoffSettings {
  retryBaseMs: number;
  retryMaxMs: number;
}

export function retryDelay(
  settings: BackoffSettings,
  failedAttempt: number,
  retryAfterMs?: number,
  random: () => number = Math.random,
): number {
  const ceiling = Math.min(settings.retryMaxMs, settings.retryBaseMs * 2 ** (failedAttempt - 1));
  const jittered = Math.floor(random() * ceiling);
  return retryAfterMs === undefined ? jittered : Math.max(jittered, Math.min(retryAfterMs, MAX_RETRY_AFTER_MS));
}
