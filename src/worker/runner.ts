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
      [DISPATCH_LANE]: dispatchLaneTask(deps),
      [PROCESS_REQUEST]: processRequestTask(deps),
      [DELIVER_WEBHOOK]: deliverWebhookTask(deps.deliverer, deps.logger),
      [CLEANUP_NONCES]: cleanupNoncesTask({ db: deps.db, logger: deps.logger }),
      [RETENTION]: retentionTask({ db: deps.db, config: deps.config, logger: deps.logger }),
    },
  };
}

function dispatchLaneTask(deps: WorkerDeps): Task {
  const log = deps.logger.child({ component: 'worker' });
  return async (rawPayload, helpers) => {
    const parsed = v.safeParse(DispatchLanePayload, rawPayload);
    if (!parsed.success) {
      // Retrying cannot fix a payload that names no lane; drop the job, loudly.
      log.error({ jobId: helpers.job.id }, 'dispatch_lane job with an invalid payload dropped');
      return;
    }
    await deps.dispatcher.dispatch(parsed.output.lane_id);
  };
}

/** Starts one try of a webhook message; the job ends once the try is under way (it holds no slot). */
function deliverWebhookTask(deliverer: WebhookDeliverer, logger: Logger): Task {
  const log = logger.child({ component: 'worker' });
  return async (rawPayload, helpers) => {
    const parsed = v.safeParse(DeliverWebhookPayload, rawPayload);
    if (!parsed.success) {
      log.error({ jobId: helpers.job.id }, 'deliver_webhook job with an invalid payload dropped');
      return;
    }
    await deliverer.deliver(parsed.output.message_id);
  };
}

/** A job of an earlier version, naming one attempt of a request: it wakes the request's lane. */
function processRequestTask(deps: WorkerDeps): Task {
  return async (rawPayload) => {
    const parsed = v.safeParse(ProcessRequestPayload, rawPayload);
    if (!parsed.success) return;
    const laneId = await findRequestLane(deps.db, parsed.output.request_id);
    if (laneId) await deps.dispatcher.dispatch(laneId);
  };
}
