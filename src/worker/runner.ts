// The worker role's graphile-worker pool: dispatch_lane jobs (each wakes a lane; the dispatcher
// starts what the lane has room for, and the job ends as soon as the calls are started),
// deliver_webhook jobs (each starts one try of a webhook message: webhooks/deliverer.ts), and the
// periodic cleanup tasks (graphile-worker's cron: each runs once per period across all workers).
// Its jobs are all short: upstream calls and webhook tries in flight hold no graphile-worker slot.
import type { RunnerOptions, Task } from 'graphile-worker';
import type pg from 'pg';
import * as v from 'valibot';
import type { Config } from '../config.ts';
import type { Db } from '../db/pool.ts';
import { DISPATCH_LANE, DispatchLanePayload, PROCESS_REQUEST, ProcessRequestPayload } from '../lanes/jobs.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { findRequestLane } from './attempts-repository.ts';
import { CLEANUP_NONCES, cleanupNoncesTask } from './cleanup-nonces.ts';
import type { Dispatcher } from './dispatcher.ts';
import { graphileLogger } from '../db/graphile-logger.ts';
import { RETENTION, retentionTask } from './retention.ts';
import type { WebhookDeliverer } from '../webhooks/deliverer.ts';
import { DELIVER_WEBHOOK, DeliverWebhookPayload } from '../webhooks/jobs.ts';

export interface WorkerDeps {
  config: Config;
  pool: pg.Pool;
  db: Db;
  metrics: Metrics;
  logger: Logger;
  dispatcher: Dispatcher;
  /** Delivers webhook messages (deliver_webhook jobs). */
  deliverer: WebhookDeliverer;
}

/** graphile-worker's options for our task list (supervisor.ts runs and restarts it). */
export function runnerOptions(deps: WorkerDeps): RunnerOptions {
  return {
    pgPool: deps.pool,
    concurrency: deps.config.workerConcurrency,
    pollInterval: deps.config.workerPollIntervalMs,
    noHandleSignals: true,
    gracefulShutdownAbortTimeout: deps.config.shutdownGraceMs,
    preset: {
      worker: {
        // Jobs' ends are recorded in batches. Besides saving round trips, this is what makes a
        // failure to record them (Postgres down) stop the pool cleanly, for the supervisor to
        // replace; unbatched, graphile-worker leaves that failure as an unhandled rejection.
        completeJobBatchDelay: 0,
        failJobBatchDelay: 0,
        // The pool fetches (and locks) jobs in batches for its workers instead of each worker
        // fetching its own: one query and one commit for many jobs.
        localQueue: { size: deps.config.workerConcurrency },
      },
    },
    logger: graphileLogger(deps.logger),
    crontab: [`*/5 * * * * ${CLEANUP_NONCES}`, `*/10 * * * * ${RETENTION}`].join('\n'),
    taskList: {
      [DISPATCH_LANE]: payloadTask(DISPATCH_LANE, DispatchLanePayload, deps.logger, (payload) =>
        deps.dispatcher.dispatch(payload.lane_id),
      ),
      // A job naming one request (lanes/jobs.ts): it wakes the request's lane.
      [PROCESS_REQUEST]: payloadTask(PROCESS_REQUEST, ProcessRequestPayload, deps.logger, async (payload) => {
        const laneId = await findRequestLane(deps.db, payload.request_id);
        if (laneId) await deps.dispatcher.dispatch(laneId);
      }),
      // Starts one try of a webhook message; the job ends once the try is under way (it holds no slot).
      [DELIVER_WEBHOOK]: payloadTask(DELIVER_WEBHOOK, DeliverWebhookPayload, deps.logger, (payload) =>
        deps.deliverer.deliver(payload.message_id),
      ),
      [CLEANUP_NONCES]: cleanupNoncesTask({ db: deps.db, logger: deps.logger }),
      [RETENTION]: retentionTask({ db: deps.db, config: deps.config, logger: deps.logger }),
    },
  };
}

/**
 * A task that reads its payload with `schema` and hands it to `handle`. Retrying cannot fix a
 * payload that does not parse: such a job is dropped, loudly.
 */
function payloadTask<Schema extends v.GenericSchema>(
  name: string,
  schema: Schema,
  logger: Logger,
  handle: (payload: v.InferOutput<Schema>) => Promise<unknown>,
): Task {
  const log = logger.child({ component: 'worker' });
  return async (rawPayload, helpers) => {
    const parsed = v.safeParse(schema, rawPayload);
    if (!parsed.success) {
      log.error({ jobId: helpers.job.id }, `${name} job with an invalid payload dropped`);
      return;
    }
    await handle(parsed.output);
  };
}
