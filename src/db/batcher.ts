// Group commit, for any statement that can act on many rows at once. Every caller waits for
// its own item's result, which exists only once the statement holding it has committed; but
// items that arrive while earlier statements are under way share the next one: one round trip
// and one commit for all of them. Under light load an item goes out alone and at once; under
// heavy load the groups grow by themselves, with no timer adding latency. A group is bounded
// in items and, when its owner says what an item weighs, in bytes: what one statement holds in
// memory (its parameters, its rows) stays bounded however large the items are.
import { isDatabaseUnavailable } from './pool.ts';

interface Pending<Item, Result> {
  item: Item;
  bytes: number;
  resolve(result: Result | Promise<Result>): void;
  reject(error: unknown): void;
}

export interface BatcherOptions<Item> {
  /** Statements under way at once (connections used). */
  maxInFlight: number;
  /** Items in one statement at most. */
  maxBatch: number;
  /**
   * Bytes in one statement at most, as `sizeOf` weighs the items: a group is cut before the
   * item that would take it past `max` (an item heavier than that goes alone).
   */
  maxBytes?: { max: number; sizeOf: (item: Item) => number };
  /** Told the size of every group written. */
  onGroup?: (size: number) => void;
  /** Told how long each group's write took (seconds), from its start (a pooled connection asked for) to its answer, when it succeeded. */
  onDone?: (seconds: number) => void;
}

/** The byte budget of a group of large items (request bodies, results): 16 MiB. */
export const GROUP_BYTES = 16 * 1024 * 1024;

/**
 * A request body larger than this goes through Postgres apart from the others: its insert in a
 * group of its own (requests/insert-batcher.ts), and left out of the claim that starts it, for
 * the worker to read alone (lanes/repository.ts). A body of megabytes takes Postgres a while to
 * write and to read, and would hold up every request of the statement it shared.
 */
export const LARGE_BODY_BYTES = 64 * 1024;

/** What `write` returns per item: its result, or a promise of it when it is found apart from its group's. */
type Written<Result> = Result | Promise<Result>;

export class Batcher<Item, Result> {
  readonly #write: (items: Item[]) => Promise<Written<Result>[]>;
  readonly #options: BatcherOptions<Item>;
  #pending: Pending<Item, Result>[] = [];
  #inFlight = 0;
  /** Statements written and items offered so far (items / statements = mean group size). */
  readonly stats = { statements: 0, items: 0 };

  /**
   * `write` gets the items of one group and returns one result per item, in order. The group's
   * statement is over (and the next may start) once `write` resolves, even if some of its
   * results are promises still pending.
   */
  constructor(write: (items: Item[]) => Promise<Written<Result>[]>, options: BatcherOptions<Item>) {
    this.#write = write;
    this.#options = options;
  }

  /** Items waiting for a statement (those of the statements under way not counted). */
  get waiting(): number {
    return this.#pending.length;
  }

  submit(item: Item): Promise<Result> {
    return new Promise((resolve, reject) => {
      const bytes = this.#options.maxBytes?.sizeOf(item) ?? 0;
      this.#pending.push({ item, bytes, resolve, reject });
      this.#flush();
    });
  }

  #flush(): void {
    while (this.#inFlight < this.#options.maxInFlight && this.#pending.length > 0) {
      const group = this.#pending.splice(0, this.#groupLength());
      this.#inFlight++;
      this.#run(group).finally(() => {
        this.#inFlight--;
        this.#flush();
      });
    }
  }

  /** How many of the pending items the next group takes. */
  #groupLength(): number {
    const { maxBatch, maxBytes } = this.#options;
    if (!maxBytes) return maxBatch;
    let length = 0;
    let bytes = 0;
    for (const pending of this.#pending) {
      if (length === maxBatch || (length > 0 && bytes + pending.bytes > maxBytes.max)) break;
      bytes += pending.bytes;
      length++;
    }
    return length;
  }

  async #run(group: Pending<Item, Result>[]): Promise<void> {
    this.stats.statements++;
    this.stats.items += group.length;
    this.#options.onGroup?.(group.length);
    const started = performance.now();
    try {
      const results = await this.#write(group.map((pending) => pending.item));
      this.#options.onDone?.((performance.now() - started) / 1000);
      group.forEach((pending, index) => pending.resolve(results[index]!));
    } catch (error) {
      if (group.length === 1 || isDatabaseUnavailable(error)) {
        for (const pending of group) pending.reject(error);
        return;
      }
      // One bad item must not fail its neighbours: write each alone to find it, one after
      // another in the group's own turn, so that statements under way stay within maxInFlight.
      // Should the database become unavailable meanwhile, the rest fail at once, as a group does.
      for (const [index, pending] of group.entries()) {
        try {
          const [result] = await this.#write([pending.item]);
          pending.resolve(result!);
        } catch (error) {
          if (isDatabaseUnavailable(error)) {
            for (const rest of group.slice(index)) rest.reject(error);
            return;
          }
          pending.reject(error);
        }
      }
    }
  }
}

/**
 * Writes a group in which an item may repeat the key of one before it (an item without a key
 * never does): only the first of each key is written, and every repeat gets `repeat`. Returns
 * one result per item, in order.
 */
export async function writeFirsts<Item, Result>(
  items: readonly Item[],
  keyOf: (item: Item) => string | undefined,
  write: (firsts: Item[]) => Promise<Result[]>,
  repeat: Result,
): Promise<Result[]> {
  const seen = new Set<string>();
  const firsts: Item[] = [];
  const isFirst = items.map((item) => {
    const key = keyOf(item);
    if (key !== undefined && seen.has(key)) return false;
    if (key !== undefined) seen.add(key);
    firsts.push(item);
    return true;
  });
  const written = firsts.length > 0 ? await write(firsts) : [];
  let next = 0;
  return isFirst.map((first) => (first ? written[next++]! : repeat));
}
