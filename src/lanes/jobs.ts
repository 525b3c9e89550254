// The graphile-worker jobs of requests. A dispatch_queue job wakes a model's queue: a worker then
// starts as many of its waiting requests as the lanes of its deployments allow
// (worker/dispatcher.ts). Accepting a request adds one in the same statement as the row (due at
// once, or, where the accepting process dispatches the request itself, later, as a fallback); so
// do retries, one per queue and quarter second they fall due in (worker/attempts-repository.ts),
// and a lane that changes health.
import * as v from 'valibot';
import { REQUEST_ID } from '../ids.ts';

const Id = v.pipe(v.union([v.string(), v.number()]), v.transform(String), v.regex(/^\d{1,18}$/));

export const DISPATCH_QUEUE = 'dispatch_queue';

export const DispatchQueuePayload = v.object({ queue_id: Id });
export type DispatchQueuePayload = v.InferOutput<typeof DispatchQueuePayload>;

/** A job naming one lane, queued only by gateways whose schema predates queues (sql/000012.sql). It wakes the lane's queue. */
export const DISPATCH_LANE = 'dispatch_lane';

export const DispatchLanePayload = v.object({ lane_id: Id });
export type DispatchLanePayload = v.InferOutput<typeof DispatchLanePayload>;

/**
 * A job naming one request, queued only by gateways whose schema predates lanes
 * (sql/000008.sql). It wakes the request's queue.
 */
export const PROCESS_REQUEST = 'process_request';

export const ProcessRequestPayload = v.object({
  request_id: v.pipe(v.string(), v.regex(REQUEST_ID)),
});
export type ProcessRequestPayload = v.InferOutput<typeof ProcessRequestPayload>;
