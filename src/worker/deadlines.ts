// Deadlines: a request not finished by its deadline fails with
// deadline_exceeded, wherever it is: waiting for lanes that are paused, open or served by no
// worker, waiting for a retry, or running (its call is aborted by the worker that holds it).
// Each worker process runs the expiry about once a second (supervisor.ts); several at once share
// the work, each taking rows the others have not locked.
import type { Db } from '../db/pool.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { inBatches } from './batches.ts';
import { expireRequests } from './deadlines-repository.ts';

/** Requests failed per statement at most: a full batch is followed at once by another. */
const EXPIRY_BATCH = 1_000;

/**
 * Fails every request whose deadline has passed, a batch at a time, until none is left or
 * `signal` is aborted (the worker is stopping: the rest is left to the others, or to its next
 * start); returns how many.
 */
export async function expireOverdue(deps: { db: Db; metrics: Metrics; logger: Logger }, signal?: AbortSignal): Promise<number> {
  const total = await inBatches(EXPIRY_BATCH, async () => {
    let batch = 0;
    for (const { mode, from, count } of await expireRequests(deps.db, EXPIRY_BATCH)) {
      deps.metrics.expired.inc({ mode, from }, count);
      batch += count;
    }
    return batch;
  }, signal);
  if (total > 0) deps.logger.info({ component: 'deadlines', expired: total }, 'requests failed: their deadline passed');
  return total;
}
