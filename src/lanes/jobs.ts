// The graphile-worker jobs of requests. A dispatch_lane job wakes a lane: a worker then starts
// as many of its waiting requests as the lane's limits allow (worker/dispatcher.ts). Accepting a
// request adds one in the same statement as the row; so does a retry, due when the retry is.
import * as v from 'valibot';
import { REQUEST_ID } from '../ids.ts';

export const DISPATCH_LANE = 'dispatch_lane';

export const DispatchLanePayload = v.object({
  lane_id: v.pipe(v.union([v.string(), v.number()]), v.transform(String), v.regex(/^\d{1,18}$/)),
});
export type DispatchLanePayload = v.InferOutput<typeof DispatchLanePayload>;

/**
 * A job naming one request, queued only by gateways whose schema predates lanes
 * (sql/000008.sql). It wakes the request's lane.
 */
export const PROCESS_REQUEST = 'process_request';

export const ProcessRequestPayload = v.object({
  request_id: v.pipe(v.string(), v.regex(REQUEST_ID)),
});
export type ProcessRequestPayload = v.InferOutput<typeof ProcessRequestPayload>;
