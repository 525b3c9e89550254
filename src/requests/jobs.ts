// The graphile-worker job that runs one attempt of a request. The accept path adds it in the
// same transaction as the request row; a failed attempt that will be retried adds the next.
import * as v from 'valibot';

export const PROCESS_REQUEST = 'process_request';

/** Which request, and which attempt this job is meant to start (1 for the first). */
export const ProcessRequestPayload = v.strictObject({
  request_id: v.pipe(v.string(), v.regex(/^req_[A-Za-z0-9]{20,40}$/)),
  attempt: v.pipe(v.number(), v.safeInteger(), v.minValue(1)),
});
export type ProcessRequestPayload = v.InferOutput<typeof ProcessRequestPayload>;
