// The rescue of stranded queues. A queue's requests are dispatched by jobs and by the processes
// that make room for them (worker/dispatcher.ts says which). Some of those live only in a
// process's memory (a call that ends on a lane with max_concurrent, room made in a process's
// capacity), and a process can die between one dispatch and the next. A job can be lost too:
// graphile-worker records a job's end by deleting its row by id, whoever holds it now, so a pool
// taken for dead (its jobs released by the sweep, supervisor.ts) that ends a job late deletes the
// row even if add_jobs has meanwhile reused it, under the same key, for a newer wake-up of the
// queue. So each worker process looks now and then for queues with requests due that nothing is
// going to dispatch, and dispatches them: a request is never left waiting for a wake-up that will
// not come. Several workers at once add one job per queue (its key).
import type { Db } from '../db/pool.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { dispatchStranded } from './rescue-repository.ts';

/** Queues rescued per statement at most: a full batch is followed at once by another. */
const RESCUE_BATCH = 100;

/**
 * Dispatches every queue with a request due for `afterMs` and nothing to dispatch it, a batch at
 * a time, until none is left or `signal` is aborted; returns how many.
 */
export async function rescueStranded(
  deps: { db: Db; metrics: Metrics; logger: Logger },
  afterMs: number,
  signal?: AbortSignal,
): Promise<number> {
  let total = 0;
  for (let batch = RESCUE_BATCH; batch === RESCUE_BATCH && !signal?.aborted; ) {
    const rescued = await dispatchStranded(deps.db, afterMs, RESCUE_BATCH);
    for (const { mode } of rescued) deps.metrics.rescued.inc({ mode });
    if (rescued.length > 0) {
      deps.logger.info(
        { component: 'rescue', queueIds: rescued.map((queue) => queue.id) },
        'queues with requests due and nothing to dispatch them: dispatched',
      );
    }
    batch = rescued.length;
    total += batch;
  }
  return total;
}
