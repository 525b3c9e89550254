// Cron task: deletes the nonces whose signatures have expired, a batch at a time so no
// statement holds its locks for long.
import type { Task } from 'graphile-worker';
import type { Db } from '../db/pool.ts';
import { deleteExpiredNonces } from '../keys/repository.ts';
import type { Logger } from '../logger.ts';

export const CLEANUP_NONCES = 'cleanup_signature_nonces';
const BATCH = 5_000;

export function cleanupNoncesTask(deps: { db: Db; logger: Logger }): Task {
  return async () => {
    let total = 0;
    for (let deleted = BATCH; deleted === BATCH; total += deleted) {
      deleted = await deleteExpiredNonces(deps.db, BATCH);
    }
    if (total > 0) deps.logger.debug({ component: 'worker', deleted: total }, 'expired signature nonces deleted');
  };
}
