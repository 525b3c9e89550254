// Group commit for accepted requests (see db/batcher.ts): concurrent submissions share one
// statement, so one commit and one add_jobs (whose NOTIFY takes a cluster-wide lock at commit)
// serve the whole group. Each submission still waits for its own commit before it is
// acknowledged. A nonce repeated within one group is a replay: only its first use is written.
// A group holds GROUP_BYTES of request bodies at most (up to MAX_BODY_BYTES each).
import { Batcher, GROUP_BYTES, writeFirsts } from '../db/batcher.ts';
import type { Db } from '../db/pool.ts';
import type { Nonce } from '../keys/repository.ts';
import { insertRequests, type InsertResult, type NewRequest } from './insert-repository.ts';

interface Item {
  request: NewRequest;
  nonce: Nonce | undefined;
}

export interface InsertBatcherOptions {
  maxInFlight?: number;
  maxBatch?: number;
  onGroup?: (size: number) => void;
}

export class InsertBatcher {
  readonly #batcher: Batcher<Item, InsertResult>;

  constructor(db: Db, options: InsertBatcherOptions = {}) {
    this.#batcher = new Batcher((items) => writeGroup(db, items), {
      maxInFlight: options.maxInFlight ?? 2,
      maxBatch: options.maxBatch ?? 500,
      maxBytes: { max: GROUP_BYTES, sizeOf: (item) => Buffer.byteLength(item.request.body) },
      ...(options.onGroup ? { onGroup: options.onGroup } : {}),
    });
  }

  /** Statements written and requests offered so far. */
  get stats(): { statements: number; requests: number } {
    return { statements: this.#batcher.stats.statements, requests: this.#batcher.stats.items };
  }

  insert(request: NewRequest, nonce: Nonce | undefined): Promise<InsertResult> {
    return this.#batcher.submit({ request, nonce });
  }
}

function writeGroup(db: Db, items: Item[]): Promise<InsertResult[]> {
  const nonceKey = (item: Item) => item.nonce && `${item.nonce.api_key_id}\n${item.nonce.nonce}`;
  return writeFirsts(items, nonceKey, (firsts) => insertRequests(db, firsts), { kind: 'replayed_nonce' });
}
