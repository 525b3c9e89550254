// SQL of the pruning of queues (worker/prune.ts): a model's queue and its lanes, deleted once no
// request refers to them and the queue has not been used for a while.
import { sql, type Selectable } from 'kysely';
import type { Database } from '../db/database.ts';
import type { Db } from '../db/pool.ts';

export type PrunedQueue = Pick<Selectable<Database['queues']>, 'id' | 'mode' | 'model'>;

// A queue no request refers to: neither through requests.queue_id nor through one of its lanes
// (a request finished before queues existed names only its lane: requests_lane_before_queues).
const unreferenced = sql`
  not exists (select from gateway.requests where requests.queue_id = queues.id)
  and not exists (
    select from gateway.lanes
    join gateway.requests on requests.lane_id = lanes.id and requests.queue_id is null
    where lanes.queue_id = queues.id
  )
`;

/**
 * Deletes up to `limit` queues, with their lanes, that no request refers to and that no API
 * process has used for `idleMs` (queues.used_at); returns them. Queues locked by another
 * statement (another worker's prune, a process looking the queue up, a request being inserted
 * into it) are skipped: the next run looks again.
 *
 * In two statements: the first locks the queues, the second, seeing everything committed before
 * the locks, deletes those that are still unreferenced. A request inserted into one of them
 * after that waits for the delete and then fails, storing nothing, and is routed again
 * (requests/service.ts); so neither statement can meet the requests' foreign key.
 */
export async function pruneIdleQueues(db: Db, idleMs: number, limit: number): Promise<PrunedQueue[]> {
  return db.transaction().execute(async (tx) => {
    const { rows: locked } = await sql<Pick<PrunedQueue, 'id'>>`
      select queues.id from gateway.queues
      where queues.used_at < now() - ${idleMs}::float8 * interval '1 millisecond' and ${unreferenced}
      order by queues.used_at
      limit ${limit}
      for update skip locked
    `.execute(tx);
    if (locked.length === 0) return [];
    const { rows } = await sql<PrunedQueue>`
      delete from gateway.queues
      where queues.id = any(${locked.map((row) => row.id)}::bigint[]) and ${unreferenced}
      returning queues.id, queues.mode, queues.model
    `.execute(tx);
    return rows;
  });
}
