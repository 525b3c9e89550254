// The memory a worker process gives to large upstream answers while it reads them
// (UPSTREAM_ANSWER_MEMORY_MB). Without it, every call in flight could hold
// UPSTREAM_MAX_RESPONSE_BYTES at once: 13,107 calls × 2 MiB is 26 GiB.
//
// An answer reads its first SMALL_ANSWER_BYTES freely: a chat completion is a few kilobytes, and
// MAX_IN_FLIGHT × that much is part of what a call costs. Past that, it reserves at once all it
// may still need: its content-length, or UPSTREAM_MAX_RESPONSE_BYTES when it has none or is
// compressed (the bytes counted are the decoded ones); an answer whose decoder has a large window
// (br, zstd) reserves that and the window before it is decoded at all. When that much is not
// free, it waits, its connection paused, in turn behind earlier ones. A reservation is never added
// to, so whatever holds memory never waits: the answers being read end, each hands its memory to
// the next in line, and none waits forever. (A reservation is at most the whole budget.) The
// call's signal (its upstream timeout, a cancel, a shutdown) ends a wait too.
//
// A waiting answer still holds what its connection had read when it paused: its first chunks,
// and a chunk in each of undici's and the socket's buffers, about 250 KB measured
// (bench/answer-memory.ts). So the worst case is this budget plus that much per call in flight,
// not UPSTREAM_MAX_RESPONSE_BYTES per call.

/** Answer bytes read without a reservation. */
export const SMALL_ANSWER_BYTES = 16 * 1024;

interface Waiter {
  readonly bytes: number;
  readonly grant: () => void;
}

export class AnswerMemory {
  readonly #budget: number;
  #reserved = 0;
  readonly #line: Waiter[] = [];

  constructor(budgetBytes: number) {
    this.#budget = budgetBytes;
  }

  /** Bytes reserved by the answers being read. */
  get reserved(): number {
    return this.#reserved;
  }

  /** Answers waiting for their reservation. */
  get waiting(): number {
    return this.#line.length;
  }

  /**
   * Reserves `bytes` (at most the budget), waiting in line until they are free; rejects with
   * the signal's reason if it aborts first. Resolves to the function that gives them back
   * (once; later calls do nothing).
   */
  async reserve(bytes: number, signal: AbortSignal): Promise<() => void> {
    signal.throwIfAborted();
    const wanted = Math.min(bytes, this.#budget);
    if (this.#line.length === 0 && this.#reserved + wanted <= this.#budget) {
      this.#reserved += wanted;
      return this.#release(wanted);
    }
    return new Promise((resolve, reject) => {
      const waiter: Waiter = {
        bytes: wanted,
        grant: () => {
          signal.removeEventListener('abort', abandon);
          resolve(this.#release(wanted));
        },
      };
      const abandon = () => {
        const index = this.#line.indexOf(waiter);
        if (index >= 0) this.#line.splice(index, 1);
        // The first in line may have been waiting behind this one.
        this.#grantInTurn();
        reject(signal.reason);
      };
      signal.addEventListener('abort', abandon, { once: true });
      this.#line.push(waiter);
    });
  }

  #release(bytes: number): () => void {
    let released = false;
    return () => {
      if (released) return;
      released = true;
      this.#reserved -= bytes;
      this.#grantInTurn();
    };
  }

  /** Grants the waiters whose turn has come, first in line first, as far as the free memory goes. */
  #grantInTurn(): void {
    while (this.#line.length > 0 && this.#reserved + this.#line[0]!.bytes <= this.#budget) {
      const waiter = this.#line.shift()!;
      this.#reserved += waiter.bytes;
      waiter.grant();
    }
  }
}
