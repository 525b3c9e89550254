// The request record (docs/api.md, "The request record"), as JSON text: what a lookup, a cancel and a
// webhook's data carry. The result is stored JSON text, spliced in as it is (only when
// completed), not parsed and written out again.
import type { Selectable } from 'kysely';
import type { RequestsTable } from '../db/database.ts';

/** The columns of gateway.requests that the record shows, its result read as text (result::text). */
export interface RecordRow
  extends Pick<Selectable<RequestsTable>, 'id' | 'status' | 'attempts' | 'created_at' | 'updated_at' | 'last_error_code'> {
  /** Verbatim JSON text; null unless completed. */
  result: string | null;
}

export function recordJson(row: RecordRow): string {
  const record = JSON.stringify({
    id: row.id,
    status: row.status,
    attempts: row.attempts,
    created_at: row.created_at.toISOString(),
    updated_at: row.updated_at.toISOString(),
    last_error_code: row.last_error_code,
  });
  return row.status === 'completed' && row.result !== null ? `${record.slice(0, -1)},"result":${row.result}}` : record;
}
