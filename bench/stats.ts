// Latency samples and their percentiles. Every sample is kept (a phase records at most a few
// hundred thousand), so percentiles are exact rather than bucketed.

export class Samples {
  #values = new Float64Array(1024);
  #length = 0;
  #sorted = true;

  add(value: number): void {
    if (this.#length === this.#values.length) {
      const grown = new Float64Array(this.#values.length * 2);
      grown.set(this.#values);
      this.#values = grown;
    }
    this.#values[this.#length++] = value;
    this.#sorted = false;
  }

  get count(): number {
    return this.#length;
  }

  /** Nearest-rank percentile, p in [0, 100]; NaN when there are no samples. */
  percentile(p: number): number {
    if (this.#length === 0) return Number.NaN;
    const values = this.#values.subarray(0, this.#length);
    if (!this.#sorted) {
      values.sort();
      this.#sorted = true;
    }
    const rank = Math.max(1, Math.ceil((p / 100) * this.#length));
    return values[Math.min(rank, this.#length) - 1]!;
  }

  get max(): number {
    return this.percentile(100);
  }
}

/** Counts of events per whole second since `start` (performance.now() milliseconds). */
export class PerSecond {
  readonly #start: number;
  readonly #counts: number[] = [];

  constructor(start: number) {
    this.#start = start;
  }

  add(at: number): void {
    const second = Math.floor((at - this.#start) / 1000);
    if (second < 0) return;
    while (this.#counts.length <= second) this.#counts.push(0);
    this.#counts[second]!++;
  }

  /** The first `seconds` whole seconds: each one's count, and the lowest and highest. */
  range(seconds: number): { min: number; max: number; series: number[] } {
    const series = Array.from({ length: seconds }, (_, i) => this.#counts[i] ?? 0);
    return { min: Math.min(...series), max: Math.max(...series), series };
  }
}

export function increment(map: Map<string, number>, key: string, by = 1): void {
  map.set(key, (map.get(key) ?? 0) + by);
}
