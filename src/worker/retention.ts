// Cron task: keeps the database from growing without bound. Deletes finished requests (and
// their attempts and webhook messages, once those are delivered or given up) created more than
// RETENTION_DAYS ago, which frees their idempotency keys; with BODY_RETENTION_HOURS set, drops
// the message bodies of finished requests older than that while keeping their records. Small
// batches, each its own short transaction; a worker stopping (graphile-worker aborts its jobs'
// signal once SHUTDOWN_GRACE_MS is over) ends the run between two, the next run doing the rest.
import type { Task } from 'graphile-worker';
import type { Config } from '../config.ts';
import type { Db } from '../db/pool.ts';
import { requestIdFloor } from '../ids.ts';
import type { Logger } from '../logger.ts';
import { inBatches } from './batches.ts';
import { deleteFinishedBefore, dropBodiesBefore } from './retention-repository.ts';

export const RETENTION = 'retention';
const BATCH = 1_000;
const HOUR_MS = 3_600_000;
const DAY_MS = 24 * HOUR_MS;

export function retentionTask(deps: {
  db: Db;
  config: Pick<Config, 'retentionDays' | 'bodyRetentionHours'>;
  logger: Logger;
}): Task {
  return async (_payload, helpers) => {
    const signal = helpers.abortSignal;
    const now = Date.now();
    const cutoff = requestIdFloor(now - deps.config.retentionDays * 24 * HOUR_MS);
    const deleted = await inBatches(BATCH, () => deleteFinishedBefore(deps.db, cutoff, BATCH), signal);

    let dropped = 0;
    if (deps.config.bodyRetentionHours !== undefined) {
      // (No earlier than 1970, before every request: a setting of more hours than have passed
      // since would make holdSince a time no Date holds.)
      const bodyCutoffMs = Math.max(0, now - deps.config.bodyRetentionHours * HOUR_MS);
      // A request still unfinished a day past the cutoff no longer holds the task back.
      const holdSince = new Date(bodyCutoffMs - DAY_MS);
      for (let more = true; more && !signal?.aborted; ) {
        const step = await dropBodiesBefore(deps.db, requestIdFloor(bodyCutoffMs), holdSince, BATCH);
        dropped += step.dropped;
        more = step.more;
      }
    }
    if (deleted > 0 || dropped > 0) {
      deps.logger.info({ component: 'retention', deleted, bodiesDropped: dropped }, 'retention applied');
    }
  };
}
