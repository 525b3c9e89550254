// The worker's chores (deadlines, pruning, rescues, retention, nonces) work through what they
// find a batch at a time, each batch one statement, so that none holds its locks or the database
// for long.

/**
 * Runs `take`, which handles up to `size` rows and says how many it handled, again while it
 * handles a full batch and `signal` is not aborted (the worker is stopping: the rest is left to
 * the others, or to its next start); returns how many rows in all.
 */
export async function inBatches(size: number, take: () => Promise<number>, signal?: AbortSignal): Promise<number> {
  let total = 0;
  for (let batch = size; batch === size && !signal?.aborted; total += batch) batch = await take();
  return total;
}
