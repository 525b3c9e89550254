// SQL of the retention task (worker/retention.ts). Request ids sort by creation time, so
// "created before" is a primary-key range.
import { sql } from 'kysely';
import type { Db } from '../db/pool.ts';

/**
 * Deletes up to `limit` finished requests created before `cutoffId` (with their attempts and
 * webhook messages). A request with a webhook message not finished yet (a try due or under way)
 * is kept until it is: a request that ended late in its life (a long deadline) may still have
 * tries to make, and deleting it would delete its event with them. A message of a disabled
 * endpoint (410) holds nothing back: it will never be sent.
 */
export async function deleteFinishedBefore(db: Db, cutoffId: string, limit: number): Promise<number> {
  const { rows } = await sql<{ deleted: string }>`
    with doomed as (
      select id from gateway.requests
      where id < ${cutoffId} and status in ('completed', 'failed', 'cancelled')
        and not exists (
          select from gateway.webhook_messages as messages
          join gateway.webhook_endpoints as endpoints on endpoints.id = messages.endpoint_id
          where messages.request_id = requests.id and messages.finished_at is null and endpoints.disabled_at is null
        )
      order by id
      limit ${limit}
      for update skip locked
    ), deleted as (
      delete from gateway.requests using doomed where requests.id = doomed.id
      returning 1
    )
    select count(*) as deleted from deleted
  `.execute(db);
  return Number(rows[0]?.deleted ?? 0);
}

/**
 * Drops the bodies of finished requests among the next `limit` ids after the task's cursor and
 * before `cutoffId`, keeping the records, and moves the cursor past them. A request of the batch
 * not finished yet holds the cursor before it, so that its body is dropped in a later run, once
 * it has finished; unless it was created before `holdSince`: one unfinished for that long (a day
 * past the cutoff) is passed over, rather than holding the task back for good. Returns the bodies
 * dropped and whether to go on (a full batch, the cursor not held).
 */
export async function dropBodiesBefore(
  db: Db,
  cutoffId: string,
  holdSince: Date,
  limit: number,
): Promise<{ dropped: number; more: boolean }> {
  const { rows } = await sql<{ dropped: string; scanned: string; held: boolean }>`
    with cursor as (
      select coalesce(
        (select last_request_id from gateway.retention_cursors where task = 'drop_bodies'), 'req_') as last_id
    ), batch as (
      select requests.id, requests.finished_at is not null as finished, requests.created_at
      from gateway.requests, cursor
      where requests.id > cursor.last_id and requests.id < ${cutoffId}
      order by requests.id
      limit ${limit}
    ), held as (
      select min(batch.id) as id from batch where not batch.finished and batch.created_at >= ${holdSince}
    ), dropped as (
      update gateway.requests set body = null
      where requests.id in (select batch.id from batch where batch.finished)
        and requests.finished_at is not null and requests.body is not null
      returning 1
    ), passed as (
      select max(batch.id) as id from batch, held where held.id is null or batch.id < held.id
    ), moved as (
      insert into gateway.retention_cursors (task, last_request_id)
      select 'drop_bodies', passed.id from passed where passed.id is not null
      on conflict (task) do update set last_request_id = excluded.last_request_id
    )
    select (select count(*) from dropped) as dropped, (select count(*) from batch) as scanned,
           (select id from held) is not null as held
  `.execute(db);
  const row = rows[0];
  return { dropped: Number(row?.dropped ?? 0), more: Number(row?.scanned ?? 0) === limit && !row?.held };
}
