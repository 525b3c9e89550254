// Group commit for accepted requests (see db/batcher.ts): concurrent submissions share one
// statement, so one commit and one add_jobs (whose NOTIFY takes a cluster-wide lock at commit)
// serve the whole group. Each submission still waits for its own commit before it is
// acknowledged. A nonce repeated within one group is a replay: only its first use is written.
// A group holds GROUP_BYTES of request bodies at most (up to MAX_BODY_BYTES each). Large bodies
// go in groups of their own, written one at a time beside the others' (LARGE_BODY_BYTES), so that
// a project sending large ones does not hold every other project's requests up behind them: a
// group of megabytes takes Postgres a while to write, and a queue of them would take every slot.
import { Batcher, GROUP_BYTES, LARGE_BODY_BYTES, writeFirsts } from '../db/batcher.ts';
import type { Db } from '../db/pool.ts';
import type { Nonce } from '../keys/repository.ts';
import { insertRequests, type InsertResult, type NewRequest } from './insert-repository.ts';

// A queue whose fallback dispatch job this process added is given no other while that job is due
// more than this much later: a statement adds none for it (no add_jobs call, no NOTIFY), and the
// job still covers its requests, due at most dispatchDelayMs after them. Once the job
// is this close to running, the next statement adds the queue's next one.
const FALLBACK_MARGIN_MS = 500;
// Queues remembered at most before the fallbacks already due are forgotten.
const MAX_FALLBACKS = 10_000;

interface Item {
  request: NewRequest;
  nonce: Nonce | undefined;
}

export interface InsertBatcherOptions {
  /** Statements under way at once, of the groups of small bodies (the large ones: one). */
  maxInFlight?: number;
  maxBatch?: number;
  onGroup?: (size: number) => void;
  /** Told how long each insert took (seconds), from asking for a pooled connection to its commit. */
  onDone?: (seconds: number) => void;
  /**
   * How long the dispatch jobs of the requests wait before they are due (0: not at all): set
   * where the process dispatches what it accepts itself, and the jobs are only its fallback.
   */
  dispatchDelayMs?: number;
}

export class InsertBatcher {
  readonly #small: Batcher<Item, InsertResult>;
  readonly #large: Batcher<Item, InsertResult>;

  /**
   * The fallback dispatch jobs this process added, by queue: when each is due (performance.now()
   * milliseconds). A cache: a job is only ever taken for pending while Postgres said so, less the
   * margin.
   */
  readonly #fallbackDue = new Map<string, number>();

  readonly #options: InsertBatcherOptions;

  constructor(db: Db, options: InsertBatcherOptions = {}) {
    const delayMs = options.dispatchDelayMs ?? 0;
    this.#options = options;
    const batcher = (maxInFlight: number) =>
      new Batcher<Item, InsertResult>((items) => this.#write(db, items, delayMs), {
        maxInFlight,
        maxBatch: options.maxBatch ?? 500,
        maxBytes: { max: GROUP_BYTES, sizeOf: (item) => Buffer.byteLength(item.request.body) },
        ...(options.onGroup ? { onGroup: options.onGroup } : {}),
        ...(options.onDone ? { onDone: options.onDone } : {}),
      });
    this.#small = batcher(options.maxInFlight ?? 2);
    this.#large = batcher(1);
  }

  /** Statements written and requests offered so far. */
  get stats(): { statements: number; requests: number } {
    return {
      statements: this.#small.stats.statements + this.#large.stats.statements,
      requests: this.#small.stats.items + this.#large.stats.items,
    };
  }

  insert(request: NewRequest, nonce: Nonce | undefined): Promise<InsertResult> {
    const batcher = Buffer.byteLength(request.body) > LARGE_BODY_BYTES ? this.#large : this.#small;
    return batcher.submit({ request, nonce });
  }

  /**
   * Stores one request alone, in the caller's transaction `tx` (the one creating its queue:
   * lanes/routing.ts), its dispatch as the groups' is: told as a group of one, and timed by
   * timedTransaction. Its fallback job is not remembered: the transaction may yet roll back, and
   * a later group adds the queue's again, keeping its time.
   */
  async insertIn(tx: Db, request: NewRequest, nonce: Nonce | undefined): Promise<InsertResult> {
    this.#options.onGroup?.(1);
    const { results } = await insertRequests(tx, [{ request, nonce }], { delayMs: this.#options.dispatchDelayMs ?? 0 });
    return results[0]!;
  }

  /**
   * Runs `transaction`, the one that stores a request with insertIn, and times it as a group's
   * write is timed (onDone): from its start, a pooled connection asked for, to its commit.
   */
  async timedTransaction<T>(transaction: () => Promise<T>): Promise<T> {
    const started = performance.now();
    const result = await transaction();
    this.#options.onDone?.((performance.now() - started) / 1000);
    return result;
  }

  #write(db: Db, items: Item[], delayMs: number): Promise<InsertResult[]> {
    const nonceKey = (item: Item) => item.nonce && `${item.nonce.api_key_id}\n${item.nonce.nonce}`;
    return writeFirsts(
      items,
      nonceKey,
      async (firsts) => {
        const covered = delayMs > 0 ? this.#covered(firsts) : [];
        // Counted from before the statement was sent, which its transaction began after: a job
        // is never thought due later than it is, however long the statement took.
        const sent = performance.now();
        const { results, fallbacks } = await insertRequests(db, firsts, { delayMs, covered });
        for (const [queueId, dueInMs] of fallbacks) this.#fallbackDue.set(queueId, sent + dueInMs);
        return results;
      },
      { kind: 'replayed_nonce' },
    );
  }

  /** The group's queues whose fallback job is pending and not about to run. */
  #covered(items: readonly Item[]): string[] {
    const now = performance.now();
    if (this.#fallbackDue.size > MAX_FALLBACKS) {
      for (const [queueId, due] of this.#fallbackDue) if (due <= now) this.#fallbackDue.delete(queueId);
    }
    const queues = new Set(items.map((item) => item.request.queue_id));
    return [...queues].filter((queueId) => (this.#fallbackDue.get(queueId) ?? -Infinity) - now > FALLBACK_MARGIN_MS);
  }
}
