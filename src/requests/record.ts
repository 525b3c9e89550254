// The request record of CONTRACT.md section 3, as JSON text: what a lookup, a cancel and a
// webhook's data carry. The result is stored JSON text, spliced in as it is (only when
// completed), not parsed and written out again.
import type { RequestStatus } from '../db/database.ts';

export interface RecordRow {
  id: string;
  status: RequestStatus;
  attempts: number;
  created_at: Date;
  updated_at: Date;
  last_error_code: string | null;
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
