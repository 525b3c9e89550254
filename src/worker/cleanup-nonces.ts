// Cron task: deletes the nonces whose signatures have expired, a batch at a time so no
// statement holds its locks for long; a worker stopping ends the run between two batches.
import type { Task } from 'graphile-worker';
import type { Db } from '../db/pool.ts';
import { deleteExpiredNonces } from '../keys/repository.ts';
import type { Logger } from '../logger.ts';
import { inBatches } from './batches.ts';

export const CLEANUP_NONCES = 'cleanup_signature_nonces';
const BATCH = 5_000;

export function cleanupNoncesTask(deps: { db: Db; logger: Logger }): Task {
  return async (_payload, helpers) => {
    const total = await inBatches(BATCH, () => deleteExpiredNonces(deps.db, BATCH), helpers.abortSignal);
    if (total > 0) deps.logger.debug({ component: 'worker', deleted: total }, 'expired signature nonces deleted');
  };
}
