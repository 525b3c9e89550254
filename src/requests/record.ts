// The request record (docs/api.md, "The request record"), as JSON: what a lookup, a cancel and a
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

/**
 * Results of at least this many characters are written into a Buffer of the record's size when
 * the record is an HTTP answer (recordBody), rather than joined to it as a string. A joined
 * string is a rope: measuring it for Content-Length makes V8 copy it flat, and sending it encodes
 * it again, about 15 and 12 ms of the event loop for a 4 MiB result here. Written into a Buffer,
 * a result is encoded once.
 */
const LARGE_RESULT_CHARS = 64 * 1024;

/** The record as JSON text. */
export function recordJson(row: RecordRow): string {
  const { head, result } = recordParts(row);
  return result === undefined ? head : `${head}${result}}`;
}

/** The record as an HTTP answer's body: its JSON text, or its UTF-8 bytes when its result is large. */
export function recordBody(row: RecordRow): string | Buffer {
  const { head, result } = recordParts(row);
  if (result === undefined) return head;
  if (result.length < LARGE_RESULT_CHARS) return `${head}${result}}`;
  const headBytes = Buffer.byteLength(head);
  const resultBytes = Buffer.byteLength(result);
  const body = Buffer.allocUnsafe(headBytes + resultBytes + 1);
  body.write(head, 0, 'utf8');
  body.write(result, headBytes, 'utf8');
  body.write('}', headBytes + resultBytes, 'utf8');
  return body;
}

/** The record's JSON without its result (the whole record when it has none), and the result to follow it. */
function recordParts(row: RecordRow): { head: string; result?: string } {
  const record = JSON.stringify({
    id: row.id,
    status: row.status,
    attempts: row.attempts,
    created_at: row.created_at.toISOString(),
    updated_at: row.updated_at.toISOString(),
    last_error_code: row.last_error_code,
  });
  if (row.status !== 'completed' || row.result === null) return { head: record };
  return { head: `${record.slice(0, -1)},"result":`, result: row.result };
}
