// Group commit for accepted requests (see db/batcher.ts): concurrent submissions share one
// statement, so one commit and one add_jobs (whose NOTIFY takes a cluster-wide lock at commit)
// serve the whole group. Each submission still waits for its own commit before it is
// acknowledged. A nonce repeated within one group is a replay: only its first use is written.
import { Batcher } from '../db/batcher.ts';
import type { Db } from '../db/pool.ts';
import { insertRequests, type InsertResult, type Lease, type NewRequest, type Nonce } from './repository.ts';

interface Item {
  request: NewRequest;
  nonce: Nonce | undefined;
  lease: Lease | undefined;
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
      ...(options.onGroup ? { onGroup: options.onGroup } : {}),
    });
  }

  /** Statements written and requests offered so far. */
  get stats(): { statements: number; requests: number } {
    return { statements: this.#batcher.stats.statements, requests: this.#batcher.stats.items };
  }

  insert(request: NewRequest, nonce: Nonce | undefined, lease?: Lease): Promise<InsertResult> {
    return this.#batcher.submit({ request, nonce, lease });
  }
}

async function writeGroup(db: Db, items: Item[]): Promise<InsertResult[]> {
  const seen = new Set<string>();
  const firsts: Item[] = [];
  const replays = new Set<number>();
  items.forEach((item, index) => {
    const nonceKey = item.nonce && `${item.nonce.api_key_id}\n${item.nonce.nonce}`;
    if (nonceKey && seen.has(nonceKey)) replays.add(index);
    else {
      if (nonceKey) seen.add(nonceKey);
      firsts.push(item);
    }
  });
  const written = firsts.length > 0 ? await insertRequests(db, firsts) : [];
  let next = 0;
  return items.map((_item, index) => (replays.has(index) ? { kind: 'replayed_nonce' } : written[next++]!));
}
