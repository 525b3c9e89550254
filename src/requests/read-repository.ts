// SQL of reading requests by id (requests/reads.ts, which groups concurrent reads): the requests
// with their results when small, and large results apart.
import { sql, type Selectable } from 'kysely';
import type { RequestsTable } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import { statement } from '../db/statement.ts';
import type { RecordRow } from './record.ts';

/** A request as the API reads it back: for lookups and for answering submissions. */
export interface RequestRow extends RecordRow, Pick<Selectable<RequestsTable>, 'project_id' | 'mode' | 'body_sha256'> {}

/** A request as findRequests reads it: its result left out (null) when larger than asked for. */
export interface RequestHead extends RequestRow {
  /** The size of its stored result (the JSON text, in bytes); null without one. */
  result_bytes: number | null;
}

/**
 * Requests by id, in the order asked (undefined for an id not found). Concurrent lookups are
 * read together (requests/reads.ts): one query, one round trip for all of them. Only the ids are
 * in the WHERE clause, so only the primary key can serve it; callers check the scope. A result
 * larger than `inlineResultBytes` is left out, for findResults to read apart.
 */
export async function findRequests(
  db: Db,
  ids: readonly string[],
  inlineResultBytes = Number.MAX_SAFE_INTEGER,
): Promise<(RequestHead | undefined)[]> {
  const { rows } = await findStatement.execute(db, { ids, inline_result_bytes: inlineResultBytes });
  const byId = new Map(rows.map((row) => [row.id, row]));
  return ids.map((id) => byId.get(id));
}

// The size of a result is stored with it (sql/000022.sql); one stored before is measured, once per
// row, which offset 0 ensures: each measure decompresses the whole result.
const findStatement = statement(['ids', 'inline_result_bytes'] as const, (v) => sql<RequestHead>`
    select id, project_id, mode, status, attempts, created_at, updated_at, last_error_code, body_sha256,
           size.result_bytes,
           case when size.result_bytes <= ${v.inline_result_bytes}::bigint then result::text end as result
    from gateway.requests
    cross join lateral (
      select coalesce(requests.result_bytes, octet_length(requests.result::text)) as result_bytes offset 0
    ) as size
    where id = any(${v.ids}::text[])
  `);

/** The stored results (JSON text) of these requests, in the order asked; undefined for a request gone. */
export async function findResults(db: Db, ids: readonly string[]): Promise<(string | null | undefined)[]> {
  const { rows } = await sql<Pick<RecordRow, 'id' | 'result'>>`
    select id, result::text as result from gateway.requests where id = any(${ids}::text[])
  `.execute(db);
  const byId = new Map(rows.map((row) => [row.id, row.result]));
  return ids.map((id) => byId.get(id));
}
