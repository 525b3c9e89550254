// The worker role's graphile-worker pool: dispatch_queue jobs (each wakes a model's queue; the
// dispatcher starts what its lanes have room for, and the job ends as soon as the calls are started),
// deliver_webhook jobs (each starts one try of a webhook message: webhooks/deliverer.ts) and
// wake_webhook_endpoint jobs (each starts the tries of an endpoint's waiting messages), and the
// periodic cleanup tasks (graphile-worker's cron: each runs once per period across all workers).
// Its jobs are all short: upstream calls and webhook tries in flight hold no graphile-worker slot.
import type { RunnerOptions, Task } from 'graphile-worker';
import type pg from 'pg';
import * as v from 'valibot';
import type { Config } from '../config.ts';
import type { Db } from '../db/pool.ts';
import {
  DISPATCH_LANE,
  DISPATCH_QUEUE,
  DispatchLanePayload,
  DispatchQueuePayload,
  PROCESS_REQUEST,
  ProcessRequestPayload,
} from '../lanes/jobs.ts';
import { findLaneQueue } from '../lanes/repository.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { findRequestQueue } from './attempts-repository.ts';
import { CLEANUP_NONCES, cleanupNoncesTask } from './cleanup-nonces.ts';
import type { Dispatcher } from './dispatcher.ts';
import { graphileLogger } from '../db/graphile-logger.ts';
import { RETENTION, retentionTask } from './retention.ts';
import type { WebhookDeliverer } from '../webhooks/deliverer.ts';
import { DELIVER_WEBHOOK, DeliverWebhookPayload, WAKE_WEBHOOK_ENDPOINT, WakeWebhookEndpointPayload } from '../webhooks/jobs.ts';

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

/** Runs of a periodic task at most: one, and two retries of it within some 10 seconds (graphile-worker's backoff). */
export const PERIODIC_MAX_ATTEMPTS = 3;

/**
 * The periodic tasks, for graphile-worker's cron. A run that keeps failing is left to the next
 * period, which does the same work: kept for graphile-worker's 25 attempts, each failing run
 * would be retried for some four days beside the runs of every later period (hundreds of jobs
 * of a task failing for a day), and used up, so logged and counted (spent-jobs.ts), only then.
 */
export const CRONTAB = [
  `*/5 * * * * ${CLEANUP_NONCES} ?max=${PERIODIC_MAX_ATTEMPTS}`,
  `*/10 * * * * ${RETENTION} ?max=${PERIODIC_MAX_ATTEMPTS}`,
].join('\n');

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
    crontab: CRONTAB,
    taskList: {
      [DISPATCH_QUEUE]: payloadTask(DISPATCH_QUEUE, DispatchQueuePayload, deps.logger, (payload) =>
        deps.dispatcher.dispatch(payload.queue_id),
      ),
      // Jobs of an older schema (lanes/jobs.ts), naming a lane or a request: they wake its queue.
      [DISPATCH_LANE]: payloadTask(DISPATCH_LANE, DispatchLanePayload, deps.logger, async (payload) => {
        const queueId = await findLaneQueue(deps.db, payload.lane_id);
        if (queueId) await deps.dispatcher.dispatch(queueId);
      }),
      [PROCESS_REQUEST]: payloadTask(PROCESS_REQUEST, ProcessRequestPayload, deps.logger, async (payload) => {
        const queueId = await findRequestQueue(deps.db, payload.request_id);
        if (queueId) await deps.dispatcher.dispatch(queueId);
      }),
      // Starts one try of a webhook message; the job ends once the try is under way (it holds no slot).
      [DELIVER_WEBHOOK]: payloadTask(DELIVER_WEBHOOK, DeliverWebhookPayload, deps.logger, (payload) =>
        deps.deliverer.deliver(payload.message_id, payload.endpoint_id),
      ),
      // Starts the tries of an endpoint's messages that waited for room or for its backoff.
      [WAKE_WEBHOOK_ENDPOINT]: payloadTask(WAKE_WEBHOOK_ENDPOINT, WakeWebhookEndpointPayload, deps.logger, (payload) =>
        deps.deliverer.wake(payload.endpoint_id, payload.deferrals),
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
