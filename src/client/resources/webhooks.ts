// client.webhooks: checking and reading the gateway's webhook deliveries (docs/webhooks.md).
// Nothing here calls the API, so a receiver that holds only the endpoint's secret can use
// `new Webhooks()` without a client.
import { WebhookVerificationError } from '../errors.ts';
import type { WebhookEvent } from '../types.ts';
import { WEBHOOK_TOLERANCE_SECONDS, webhookSignatureMatches, type WebhookBody } from '../webhooks.ts';

/**
 * A delivery's request headers: a `Headers`, or a plain object such as Node's
 * `IncomingMessage.headers` (names in any case, values a string or a list of strings).
 */
export type WebhookHeaders = Headers | Record<string, string | readonly string[] | undefined>;

export class Webhooks {
  /**
   * Verifies a delivery and returns its event. `body` is the raw body exactly as received; a
   * parsed object cannot be verified, since the signature covers the bytes. `secret` is the
   * endpoint's `whsec_...`. The delivery must carry a v1 signature of this body under `secret`
   * and a webhook-timestamp within 300 s of now; otherwise the promise rejects with a
   * WebhookVerificationError whose `code` says why. Deliveries are at least once: the
   * webhook-id header is the same on every retry of one event.
   */
  async unwrap(body: WebhookBody, headers: WebhookHeaders, secret: string): Promise<WebhookEvent> {
    if (typeof body !== 'string' && !(body instanceof Uint8Array) && !(body instanceof ArrayBuffer)) {
      throw new TypeError(
        'webhooks.unwrap needs the raw body as received (a string or bytes), not a parsed object: ' +
          'the signature covers the exact bytes.',
      );
    }
    const id = header(headers, 'webhook-id');
    const timestampHeader = header(headers, 'webhook-timestamp');
    const signature = header(headers, 'webhook-signature');

    if (!/^\d+$/.test(timestampHeader)) {
      const shown = timestampHeader.slice(0, 40);
      throw new WebhookVerificationError('invalid_header', `webhook-timestamp is not Unix seconds: ${shown}`);
    }
    // The time is checked before the signature, as the official libraries do: no HMAC for a stale delivery.
    const timestamp = Number(timestampHeader);
    const age = Math.floor(Date.now() / 1000) - timestamp;
    if (age > WEBHOOK_TOLERANCE_SECONDS) {
      const message = `webhook-timestamp is ${age} s old, more than ${WEBHOOK_TOLERANCE_SECONDS} s.`;
      throw new WebhookVerificationError('timestamp_too_old', message);
    }
    if (-age > WEBHOOK_TOLERANCE_SECONDS) {
      const message = `webhook-timestamp is ${-age} s ahead, more than ${WEBHOOK_TOLERANCE_SECONDS} s: check the clocks.`;
      throw new WebhookVerificationError('timestamp_in_future', message);
    }
    if (!(await webhookSignatureMatches(signature, secret, id, timestamp, body))) {
      const message = 'No v1 signature in webhook-signature matches the body under this secret.';
      throw new WebhookVerificationError('invalid_signature', message);
    }
    return parseEvent(body);
  }
}

/** The header's value; list values and repeated names (in other cases) are joined by spaces. */
function header(headers: WebhookHeaders, name: string): string {
  let value: string | null;
  if (typeof (headers as Headers).get === 'function') {
    value = (headers as Headers).get(name);
  } else {
    const values = Object.entries(headers as Record<string, string | readonly string[] | undefined>)
      .filter(([key, found]) => key.toLowerCase() === name && found !== undefined)
      .flatMap(([, found]) => found as string | readonly string[]);
    value = values.length === 0 ? null : values.join(' ');
  }
  if (value === null || value.trim() === '') {
    throw new WebhookVerificationError('missing_header', `The ${name} header is missing.`);
  }
  return value.trim();
}

function parseEvent(body: WebhookBody): WebhookEvent {
  let event: unknown;
  try {
    const text = typeof body === 'string' ? body : new TextDecoder('utf-8', { fatal: true }).decode(body);
    event = JSON.parse(text);
  } catch {
    throw new WebhookVerificationError('invalid_body', 'The webhook body is not JSON.');
  }
  const { type, timestamp, data } = (event ?? {}) as Record<string, unknown>;
  if (typeof type !== 'string' || typeof timestamp !== 'string' || typeof data !== 'object' || data === null) {
    throw new WebhookVerificationError('invalid_body', 'The webhook body is not an event { type, timestamp, data }.');
  }
  return event as WebhookEvent;
}
