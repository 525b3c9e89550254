// The graphile-worker job of a webhook message: deliver_webhook tries to deliver it once
// (deliverer.ts). The transaction that makes a request terminal adds the first
// (gateway.enqueue_webhooks, sql/000009.sql); each retry adds the next, due when the retry is.
import * as v from 'valibot';
import { WEBHOOK_MESSAGE_ID } from '../ids.ts';

export const DELIVER_WEBHOOK = 'deliver_webhook';

export const DeliverWebhookPayload = v.object({
  message_id: v.pipe(v.string(), v.regex(WEBHOOK_MESSAGE_ID)),
});
export type DeliverWebhookPayload = v.InferOutput<typeof DeliverWebhookPayload>;
