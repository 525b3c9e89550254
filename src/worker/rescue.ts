// The rescue of stranded queues and webhook endpoints. A queue's requests are dispatched by jobs
// and by the processes that make room for them (worker/dispatcher.ts says which). Some of those
// live only in a process's memory (a call that ends on a lane with max_concurrent, room made in a
// process's capacity), and a process can die between one dispatch and the next. A job can be
// lost too: graphile-worker records a job's end by deleting its row by id, whoever holds it now,
// so a pool taken for dead (its jobs released by the sweep, supervisor.ts) that ends a job late
// deletes the row even if add_jobs has meanwhile reused it, under the same key, for a newer
// wake-up of the queue. So each worker process looks now and then for queues with requests due
// that nothing is going to dispatch, and dispatches them: a request is never left waiting for a
// wake-up that will not come. Several workers at once add one job per queue (its key).
//
// Webhook messages alike: those that wait for room or for their endpoint's backoff have their
// endpoint's one wake job (webhooks/deliverer.ts), a job that the same late end can delete. An
// endpoint with messages due and nothing to deliver them gets its wake job again. A message left
// pending on a disabled endpoint (the 410 that disabled it did not see it, and a claim that
// raced the 410 left it to a wake that a disabled endpoint does not get) is abandoned, as the
// 410 abandons the others.
//
// A job that failed (a database that refused statements for minutes fails the jobs run meanwhile)
// waits out graphile-worker's backoff, which reaches hours after a few failures. One that has
// waited so for a period, and will for another, does not count as serving its queue or endpoint:
// the rescue makes it due now (rescue-repository.ts, stalled), so that the work accepted before
// an outage is done once it ends, and a job that fails every time runs about once a period.
import type { Db } from '../db/pool.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { inBatches } from './batches.ts';
import { abandonOnDisabledEndpoints, dispatchStranded, wakeStrandedEndpoints } from './rescue-repository.ts';

/** Queues, or endpoints, rescued per statement at most: a full batch is followed at once by another. */
const RESCUE_BATCH = 100;
/** Messages of disabled endpoints abandoned per statement at most, as RESCUE_BATCH. */
const ABANDON_BATCH = 1_000;

/**
 * Dispatches every queue with a request due for `afterMs` and nothing to dispatch it, wakes
 * every webhook endpoint with a message due for as long and nothing to deliver it, and abandons
 * the messages still pending on endpoints disabled for as long, a batch at a time, until none is
 * left or `signal` is aborted.
 */
export async function rescueStranded(deps: { db: Db; metrics: Metrics; logger: Logger }, afterMs: number, signal?: AbortSignal): Promise<void> {
  const log = deps.logger.child({ component: 'rescue' });
  await inBatches(RESCUE_BATCH, async () => {
    const queues = await dispatchStranded(deps.db, afterMs, RESCUE_BATCH);
    for (const { mode } of queues) deps.metrics.rescuedQueues.inc({ mode });
    if (queues.length > 0) log.info({ queueIds: queues.map((queue) => queue.id) }, 'queues with requests due and nothing to dispatch them: dispatched');
    return queues.length;
  }, signal);
  await inBatches(RESCUE_BATCH, async () => {
    const endpoints = await wakeStrandedEndpoints(deps.db, afterMs, RESCUE_BATCH);
    deps.metrics.rescuedEndpoints.inc(endpoints.length);
    if (endpoints.length > 0) log.info({ endpointIds: endpoints }, 'webhook endpoints with messages due and nothing to deliver them: woken');
    return endpoints.length;
  }, signal);
  await inBatches(ABANDON_BATCH, async () => {
    const abandoned = await abandonOnDisabledEndpoints(deps.db, afterMs, ABANDON_BATCH);
    const messages = abandoned.reduce((sum, endpoint) => sum + endpoint.messages, 0);
    if (messages > 0) {
      log.info({ endpointIds: abandoned.map((endpoint) => endpoint.endpoint_id), messages }, 'webhook messages pending on disabled endpoints: abandoned');
    }
    return messages;
  }, signal);
}
