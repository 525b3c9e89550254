// Group commit for accepted requests. Every submission waits for its own commit (an
// acknowledgement is only ever sent after it), but submissions that arrive while earlier
// inserts are under way share the next statement: one commit, one add_jobs, one NOTIFY for
// all of them. Under light load each insert goes out alone and at once; under heavy load the
// groups grow by themselves, with no timer adding latency.
import type { Db } from '../db/pool.ts';
import { isDatabaseUnavailable } from '../db/pool.ts';
import { insertRequests, type InsertResult, type NewRequest, type Nonce } from './repository.ts';

interface Pending {
  request: NewRequest;
  nonce: Nonce | undefined;
  resolve(result: InsertResult): void;
  reject(error: unknown): void;
}

export interface InsertBatcherOptions {
  /** Statements under way at once (connections used for inserts). */
  maxInFlight?: number;
  /** Requests in one statement at most. */
  maxBatch?: number;
  /** Told the size of every group written. */
  onGroup?: (size: number) => void;
}

export class InsertBatcher {
  readonly #db: Db;
  readonly #maxInFlight: number;
  readonly #maxBatch: number;
  readonly #onGroup: ((size: number) => void) | undefined;
  #pending: Pending[] = [];
  #inFlight = 0;
  /** Statements written and requests offered so far (requests / statements = mean group size). */
  readonly stats = { statements: 0, requests: 0 };

  constructor(db: Db, options: InsertBatcherOptions = {}) {
    this.#db = db;
    this.#maxInFlight = options.maxInFlight ?? 2;
    this.#maxBatch = options.maxBatch ?? 500;
    this.#onGroup = options.onGroup;
  }

  insert(request: NewRequest, nonce: Nonce | undefined): Promise<InsertResult> {
    return new Promise((resolve, reject) => {
      this.#pending.push({ request, nonce, resolve, reject });
      this.#flush();
    });
  }

  #flush(): void {
    while (this.#inFlight < this.#maxInFlight && this.#pending.length > 0) {
      const batch = this.#pending.splice(0, this.#maxBatch);
      this.#inFlight++;
      this.#write(batch).finally(() => {
        this.#inFlight--;
        this.#flush();
      });
    }
  }

  async #write(batch: Pending[]): Promise<void> {
    // A nonce sent twice in one group is a replay: only its first use goes to the database.
    const seen = new Set<string>();
    const unique: Pending[] = [];
    for (const item of batch) {
      const nonceKey = item.nonce && `${item.nonce.api_key_id}\n${item.nonce.nonce}`;
      if (nonceKey && seen.has(nonceKey)) item.resolve({ kind: 'replayed_nonce' });
      else {
        if (nonceKey) seen.add(nonceKey);
        unique.push(item);
      }
    }
    this.stats.statements++;
    this.stats.requests += unique.length;
    this.#onGroup?.(unique.length);
    try {
      const results = await insertRequests(this.#db, unique);
      unique.forEach((item, index) => item.resolve(results[index]!));
    } catch (error) {
      if (unique.length === 1 || isDatabaseUnavailable(error)) {
        for (const item of unique) item.reject(error);
        return;
      }
      // One bad item must not fail its neighbours: write each alone to find it.
      await Promise.all(
        unique.map((item) => insertRequests(this.#db, [item]).then(([result]) => item.resolve(result!), item.reject)),
      );
    }
  }
}
