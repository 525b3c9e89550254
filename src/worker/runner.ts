// The worker role: a graphile-worker pool running process_request jobs, and the periodic
// cleanup tasks (graphile-worker's cron: each runs once per period across all workers).
import type { RunnerOptions } from 'graphile-worker';
import type pg from 'pg';
import type { Config } from '../config.ts';
import type { Db } from '../db/pool.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { PROCESS_REQUEST } from '../requests/jobs.ts';
import { CLEANUP_NONCES, cleanupNoncesTask } from './cleanup-nonces.ts';
import { graphileLogger } from './graphile-logger.ts';
import { RETENTION, retentionTask } from './retention.ts';
import { processRequestTask, type Attempts } from './process-request.ts';

export interface WorkerDeps {
  config: Config;
  pool: pg.Pool;
  db: Db;
  metrics: Metrics;
  logger: Logger;
  /** Runs the attempts that process_request jobs name (createAttempts). */
  attempts: Attempts;
  /** This process runs requests it accepts itself, each with a lease job (LocalAttempts). */
  localAttempts?: boolean;
}

/** How long, on average, a fetch that found no job holds the next one back (see below). */
const REFETCH_DELAY_MS = 100;

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
        localQueue: {
          size: deps.config.workerConcurrency,
          // Every add_jobs announces its jobs (NOTIFY jobs:insert) and the local queue fetches
          // on each announcement. With local attempts nearly all are lease jobs of this
          // process's own requests, not due for WORKER_DEAD_AFTER_MS: at 2,000 requests a
          // second that made a hundred fetches a second that found nothing, each walking the
          // lease rows deleted since the last vacuum (3 to 4 ms; a third of a core of
          // Postgres). So a fetch that finds nothing holds the next one back for 0.5 to 1.5
          // times this delay, unless enough jobs are announced meanwhile (graphile-worker's
          // refetchDelay); a job queued then waits up to that much longer.
          ...(deps.localAttempts
            ? { refetchDelay: { durationMs: Math.min(REFETCH_DELAY_MS, deps.config.workerPollIntervalMs) } }
            : {}),
        },
      },
    },
    logger: graphileLogger(deps.logger),
    crontab: [`*/5 * * * * ${CLEANUP_NONCES}`, `*/10 * * * * ${RETENTION}`].join('\n'),
    taskList: {
      [PROCESS_REQUEST]: processRequestTask(deps.attempts, deps.logger),
      [CLEANUP_NONCES]: cleanupNoncesTask({ db: deps.db, logger: deps.logger }),
      [RETENTION]: retentionTask({ db: deps.db, config: deps.config, logger: deps.logger }),
    },
  };
}
