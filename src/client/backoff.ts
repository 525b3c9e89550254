// Backoff, the one kind that the client and the gateway use: waits that double from a first one
// up to a ceiling, and jitter, which makes a wait uneven at random so that callers that failed
// together do not come back together. Pure and without dependencies like the rest of
// src/client/; the gateway imports it from here.

/**
 * The wait before try `n` (1, 2, ...) of a backoff: `firstMs`, doubled for each try after the
 * first, up to `maxMs` (a ceiling below `firstMs` is no ceiling: the wait stays `firstMs`).
 */
export function doubling(n: number, firstMs: number, maxMs: number): number {
  // The exponent is bounded, so that a zero first wait stays 0 and not 0 * Infinity.
  return Math.min(Math.max(firstMs, maxMs), firstMs * 2 ** Math.min(Math.max(n - 1, 0), 64));
}

/**
 * `ms` made uneven at random: uniformly distributed from `ms * (1 - less)` to `ms * (1 + more)`.
 * `less` 1 is full jitter (anything from 0 to `ms`); `random` is for tests.
 */
export function jitter(ms: number, less: number, more = 0, random: () => number = Math.random): number {
  const lowest = ms * (1 - less);
  return lowest + (ms * (1 + more) - lowest) * random();
}

/**
 * The waits of something tried again until it works (restarting a process, reconnecting,
 * polling): each `next()` is the following wait of doubling(), and `reset()` starts again from
 * the first once it has worked.
 */
export class Backoff {
  readonly #firstMs: number;
  readonly #maxMs: number;
  #tries = 0;

  constructor(firstMs: number, maxMs: number) {
    this.#firstMs = firstMs;
    this.#maxMs = maxMs;
  }

  /** The wait before this try; the one after it is twice as long, up to the ceiling. */
  next(): number {
    return doubling(++this.#tries, this.#firstMs, this.#maxMs);
  }

  /** What next() returns when it is called. */
  get upcoming(): number {
    return doubling(this.#tries + 1, this.#firstMs, this.#maxMs);
  }

  /** It worked: the next wait is the first again. */
  reset(): void {
    this.#tries = 0;
  }
}
