// The graphile-worker jobs of webhooks (deliverer.ts):
// - deliver_webhook tries to deliver one message once. The transaction that makes a request
//   terminal adds the first (gateway.enqueue_webhooks, sql/000014.sql); each retry adds the next,
//   due when the retry is.
// - wake_webhook_endpoint tries the messages of one endpoint that wait, due, for room or for the
//   endpoint's backoff (they have no job of their own). One per endpoint at most: its job key.
import * as v from 'valibot';
import { WEBHOOK_ENDPOINT_ID, WEBHOOK_MESSAGE_ID } from '../ids.ts';

export const DELIVER_WEBHOOK = 'deliver_webhook';

export const DeliverWebhookPayload = v.object({
  message_id: v.pipe(v.string(), v.regex(WEBHOOK_MESSAGE_ID)),
  /** The message's endpoint (absent from the jobs of schemas before sql/000014.sql). */
  endpoint_id: v.optional(v.pipe(v.string(), v.regex(WEBHOOK_ENDPOINT_ID))),
});
export type DeliverWebhookPayload = v.InferOutput<typeof DeliverWebhookPayload>;

export const WAKE_WEBHOOK_ENDPOINT = 'wake_webhook_endpoint';

export const WakeWebhookEndpointPayload = v.object({
  endpoint_id: v.pipe(v.string(), v.regex(WEBHOOK_ENDPOINT_ID)),
  /** Wakes in a row that left messages waiting for room: the next waits longer. */
  deferrals: v.optional(v.pipe(v.number(), v.integer(), v.minValue(0)), 0),
});
export type WakeWebhookEndpointPayload = v.InferOutput<typeof WakeWebhookEndpointPayload>;

/** What the job key of an endpoint's wake job starts with: its endpoint's id follows. */
export const WAKE_KEY_PREFIX = `${WAKE_WEBHOOK_ENDPOINT}:`;

/** The job key of an endpoint's wake job: one at a time per endpoint. */
export function wakeJobKey(endpointId: string): string {
  return `${WAKE_KEY_PREFIX}${endpointId}`;
}
