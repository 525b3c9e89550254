// Reading requests by id for lookups and waits, concurrent reads together (see
// db/batcher.ts): one statement reads a group of up to 500 requests with their results, as long
// as each result is small, as chat completions are. A larger result is left out of its group's
// statement and read apart, in groups of GROUP_BYTES at most, a few at a time: however many
// large results are asked for at once, the process holds only a few of them being read, besides
// those on their way to their callers.
import { Batcher, GROUP_BYTES } from '../db/batcher.ts';
import type { Db } from '../db/pool.ts';
import { findRequests, findResults, type RequestRow } from './read-repository.ts';

export interface RequestReadsOptions {
  /** Read statements under way at once, for each kind (groups of requests, large results). */
  maxInFlight?: number;
  /** Bytes of results read in one statement at most. */
  maxBytes?: number;
}

/** Requests read in one statement at most. */
const MAX_BATCH = 500;

/** A large result to read: its request and its size. */
interface LargeResult {
  id: string;
  bytes: number;
}

/** Reads requests by id (undefined for an id not found). */
export function createRequestReads(db: Db, options: RequestReadsOptions = {}): Batcher<string, RequestRow | undefined> {
  const maxInFlight = options.maxInFlight ?? 2;
  const maxBytes = options.maxBytes ?? GROUP_BYTES;
  // Results up to this size are read with their requests: a full group of them holds maxBytes.
  const inlineResultBytes = Math.floor(maxBytes / MAX_BATCH);
  const results = new Batcher<LargeResult, string | null | undefined>((items) => findResults(db, items.map((item) => item.id)), {
    maxInFlight,
    maxBatch: MAX_BATCH,
    maxBytes: { max: maxBytes, sizeOf: (item) => item.bytes },
  });
  return new Batcher(
    async (ids: string[]) => {
      const heads = await findRequests(db, ids, inlineResultBytes);
      return heads.map((head) => {
        if (head === undefined) return undefined;
        const { result_bytes: bytes, ...row } = head;
        if (bytes === null || row.result !== null) return row;
        // Its result is read apart; a request deleted meanwhile (retention) is not found.
        return results.submit({ id: row.id, bytes }).then((result) => (result === undefined ? undefined : { ...row, result }));
      });
    },
    { maxInFlight, maxBatch: MAX_BATCH },
  );
}
