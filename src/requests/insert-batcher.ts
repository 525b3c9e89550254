// Group commit for accepted requests (see db/batcher.ts): concurrent submissions share one
// statement, so one commit and one add_jobs (whose NOTIFY takes a cluster-wide lock at commit)
// serve the whole group. Each submission still waits for its own commit before it is
// acknowledged. A nonce repeated within one group is a replay: only its first use is written.
// A group holds GROUP_BYTES of request bodies at most (up to MAX_BODY_BYTES each). Large bodies
// go in groups of their own, written one at a time beside the others' (LARGE_BODY_BYTES).
import { Batcher, GROUP_BYTES, writeFirsts } from '../db/batcher.ts';
import type { Db } from '../db/pool.ts';
import type { Nonce } from '../keys/repository.ts';
import { insertRequests, type InsertResult, type NewRequest } from './insert-repository.ts';

// Bodies larger than this are grouped apart and written a statement at a time, so that a project
// sending large ones does not hold every other project's requests up behind them: a group of
// megabytes takes Postgres a while to write, and a queue of them would take every slot.
const LARGE_BODY_BYTES = 64 * 1024;

interface Item {
  request: NewRequest;
  nonce: Nonce | undefined;
}

export interface InsertBatcherOptions {
  /** Statements under way at once, of the groups of small bodies (the large ones: one). */
  maxInFlight?: number;
  maxBatch?: number;
  onGroup?: (size: number) => void;
  /**
   * How long the dispatch jobs of the requests wait before they are due (0: not at all): set
   * where the process dispatches what it accepts itself, and the jobs are only its fallback.
   */
  dispatchDelayMs?: number;
}

export class InsertBatcher {
  readonly #small: Batcher<Item, InsertResult>;
  readonly #large: Batcher<Item, InsertResult>;

  constructor(db: Db, options: InsertBatcherOptions = {}) {
    const batcher = (maxInFlight: number) =>
      new Batcher<Item, InsertResult>((items) => writeGroup(db, items, options.dispatchDelayMs ?? 0), {
        maxInFlight,
        maxBatch: options.maxBatch ?? 500,
        maxBytes: { max: GROUP_BYTES, sizeOf: (item) => Buffer.byteLength(item.request.body) },
        ...(options.onGroup ? { onGroup: options.onGroup } : {}),
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
}

function writeGroup(db: Db, items: Item[], dispatchDelayMs: number): Promise<InsertResult[]> {
  const nonceKey = (item: Item) => item.nonce && `${item.nonce.api_key_id}\n${item.nonce.nonce}`;
  return writeFirsts(items, nonceKey, (firsts) => insertRequests(db, firsts, dispatchDelayMs), { kind: 'replayed_nonce' });
}
