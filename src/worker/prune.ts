// Pruning: a model's queue and its lanes are created on the model's first request, and models
// are partly the clients' to name (an upstream's pattern serves them), so rows nobody uses are
// deleted. A queue that no request refers to and that no API process has used for
// PRUNE_IDLE_QUEUES_AFTER goes, with its lanes; the model's next request creates them again.
// A queue with requests, finished ones included, stays: retention, deleting old requests, is what
// frees the queues of models no longer asked for, and the lanes that usage reports name are kept
// as long as the requests they report. Each worker process runs it now and then (supervisor.ts);
// several at once share the work, each taking queues the others have not locked.
import type { Db } from '../db/pool.ts';
import type { Logger } from '../logger.ts';
import { inBatches } from './batches.ts';
import { pruneIdleQueues } from './prune-repository.ts';

/** Queues deleted per statement at most: a full batch is followed at once by another. */
const PRUNE_BATCH = 500;

/**
 * Deletes every queue (and its lanes) unreferenced and unused for `idleMs`, a batch at a time,
 * until none is left or `signal` is aborted; returns the ids deleted.
 */
export async function pruneQueues(
  deps: { db: Db; logger: Logger },
  idleMs: number,
  signal?: AbortSignal,
): Promise<string[]> {
  const pruned: string[] = [];
  await inBatches(PRUNE_BATCH, async () => {
    const deleted = await pruneIdleQueues(deps.db, idleMs, PRUNE_BATCH);
    pruned.push(...deleted.map((queue) => queue.id));
    return deleted.length;
  }, signal);
  if (pruned.length > 0) deps.logger.info({ component: 'prune', queues: pruned.length }, 'idle queues and their lanes deleted');
  return pruned;
}
