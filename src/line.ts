// A bounded line of asynchronous work, first come first served: at most `inFlight` runs under
// way, `waiting` more in line for their turn, and beyond that a refusal at once. It keeps a kind
// of work that a flood can bring (new queues of invented model names) to a few of the pool's
// connections, so that the rest serve everyone else.

export interface LineOptions {
  /** Runs under way at once. */
  inFlight: number;
  /** Runs waiting for their turn. */
  waiting: number;
  /** The error thrown when the line is full. */
  refusal: () => Error;
  /** Told of each refusal. */
  onRefused?: (() => void) | undefined;
}

export class Line {
  readonly #options: LineOptions;
  #inFlight = 0;
  /** Each waiter's turn: called when a run ends, handing it that run's place. */
  readonly #waiting: (() => void)[] = [];

  constructor(options: LineOptions) {
    this.#options = options;
  }

  get inFlight(): number {
    return this.#inFlight;
  }

  get waiting(): number {
    return this.#waiting.length;
  }

  /** Runs `work` when a place is free, or throws the refusal when the line is full too. */
  async run<T>(work: () => Promise<T>): Promise<T> {
    if (this.#inFlight < this.#options.inFlight) {
      this.#inFlight++;
    } else if (this.#waiting.length < this.#options.waiting) {
      await new Promise<void>((turn) => this.#waiting.push(turn));
    } else {
      this.#options.onRefused?.();
      throw this.#options.refusal();
    }
    try {
      return await work();
    } finally {
      const next = this.#waiting.shift();
      if (next) next();
      else this.#inFlight--;
    }
  }
}
