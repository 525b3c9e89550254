// The wait before trying something again that keeps failing (restarting a process or a pool,
// reconnecting, retrying a statement): it doubles after each try, up to a ceiling, and starts
// again from the floor once things work. It has no jitter, unlike the delay between the
// attempts of a request (worker/backoff.ts).
export class Backoff {
  readonly #minMs: number;
  readonly #maxMs: number;
  #nextMs: number;

  constructor(minMs: number, maxMs: number) {
    this.#minMs = minMs;
    this.#maxMs = maxMs;
    this.#nextMs = minMs;
  }

  /** The wait before this try; the one after it is twice as long, up to the ceiling. */
  next(): number {
    const delayMs = this.#nextMs;
    this.#nextMs = Math.min(delayMs * 2, this.#maxMs);
    return delayMs;
  }

  /** What next() returns when it is called. */
  get upcoming(): number {
    return this.#nextMs;
  }

  /** It worked: the next wait is the shortest again. */
  reset(): void {
    this.#nextMs = this.#minMs;
  }
}
