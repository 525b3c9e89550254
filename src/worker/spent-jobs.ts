// Spent jobs: a graphile-worker job that throws is run again after a wait that grows each time
// (exp(attempts) seconds, at most about 6 hours), up to its max_attempts (25: some 4 days; a
// periodic task's 3, runner.ts), and then kept in graphile-worker's table for good, never run
// again. Nothing is lost with it: a request's deadline ends it whatever its jobs do
// (deadlines.ts), and a queue with requests due, or an endpoint with webhook messages due, that
// only a spent job was for is dispatched or woken by the rescue (rescue.ts), which counts no
// spent job; a periodic task runs again next period.
// So each worker process deletes the spent jobs now and then (supervisor.ts), saying which, with
// their last errors, and counting them by task: the table does not grow with them, and a task
// that keeps failing shows.
import type { Db } from '../db/pool.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { inBatches } from './batches.ts';
import { deleteSpentJobs } from './spent-jobs-repository.ts';

/** Spent jobs deleted per statement at most: a full batch is followed at once by another. */
const SPENT_BATCH = 100;
/** The characters of a job's last error that its log line keeps. */
const ERROR_CHARS = 500;

/** Deletes every spent job, a batch at a time, until none is left or `signal` is aborted; returns how many. */
export async function deleteSpent(deps: { db: Db; metrics: Metrics; logger: Logger }, signal?: AbortSignal): Promise<number> {
  const log = deps.logger.child({ component: 'jobs' });
  return inBatches(SPENT_BATCH, async () => {
    const jobs = await deleteSpentJobs(deps.db, SPENT_BATCH);
    for (const job of jobs) deps.metrics.spentJobsDeleted.inc({ task: job.task });
    if (jobs.length > 0) {
      log.warn(
        { jobs: jobs.map((job) => ({ ...job, lastError: job.lastError?.slice(0, ERROR_CHARS) ?? null })) },
        'jobs that used up their attempts deleted',
      );
    }
    return jobs.length;
  }, signal);
}
