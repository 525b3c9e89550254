// Webhook signatures as the Standard Webhooks specification defines them (docs/webhooks.md, "What
// is sent"), with Web Crypto only. The server signs its deliveries with signWebhook and the client's
// webhooks.unwrap checks them with it, so the two cannot drift apart:
//
//   webhook-id: <delivery id, the same on every retry>
//   webhook-timestamp: <unix seconds>
//   webhook-signature: v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>"> [v1,<...> ...]
//
// The HMAC key is the base64 after `whsec_` in the endpoint's secret. During a secret rotation
// the header carries one signature per active secret, separated by spaces.

/** How far webhook-timestamp may be from now, either way, in seconds. */
export const WEBHOOK_TOLERANCE_SECONDS = 300;

export const WEBHOOK_SECRET_PREFIX = 'whsec_';

/** A delivery's raw body: the exact bytes received (a string is taken as UTF-8). */
export type WebhookBody = string | Uint8Array | ArrayBuffer;

/**
 * One `v1,<base64>` signature of a delivery, for the webhook-signature header (join several
 * with a space). `timestamp` is in Unix seconds, as sent in webhook-timestamp.
 */
export async function signWebhook(secret: string, id: string, timestamp: number, body: WebhookBody): Promise<string> {
  if (!Number.isSafeInteger(timestamp)) throw new TypeError('The webhook timestamp must be a whole number of seconds.');
  const key = await crypto.subtle.importKey('raw', webhookKey(secret), { name: 'HMAC', hash: 'SHA-256' }, false, ['sign']);
  const signed = concat(utf8.encode(`${id}.${timestamp}.`), bytesOf(body));
  return `v1,${toBase64(await crypto.subtle.sign('HMAC', key, signed))}`;
}

/**
 * Whether any `v1` entry of a webhook-signature header is the signature of this delivery under
 * `secret`; entries of other versions are ignored. Compared in constant time.
 */
export async function webhookSignatureMatches(
  signatureHeader: string,
  secret: string,
  id: string,
  timestamp: number,
  body: WebhookBody,
): Promise<boolean> {
  const expected = (await signWebhook(secret, id, timestamp, body)).slice('v1,'.length);
  let matched = false;
  for (const entry of signatureHeader.split(' ')) {
    const comma = entry.indexOf(',');
    if (comma === -1 || entry.slice(0, comma) !== 'v1') continue;
    // Every entry is compared, so the time taken does not tell which one matched.
    if (constantTimeEqual(entry.slice(comma + 1), expected)) matched = true;
  }
  return matched;
}

/** The HMAC key of a `whsec_<base64>` secret; a secret without the prefix is taken as base64 too. */
function webhookKey(secret: string): Uint8Array<ArrayBuffer> {
  if (typeof secret !== 'string') throw new TypeError('The webhook secret must be a string, whsec_ followed by base64.');
  const encoded = secret.startsWith(WEBHOOK_SECRET_PREFIX) ? secret.slice(WEBHOOK_SECRET_PREFIX.length) : secret;
  let decoded: string;
  try {
    decoded = atob(encoded);
  } catch {
    throw new TypeError('The webhook secret must be whsec_ followed by base64, as shown when the endpoint was added.');
  }
  if (decoded.length === 0) throw new TypeError('The webhook secret is empty.');
  return Uint8Array.from(decoded, (char) => char.charCodeAt(0));
}

const utf8 = new TextEncoder();

function bytesOf(body: WebhookBody): Uint8Array {
  if (typeof body === 'string') return utf8.encode(body);
  if (body instanceof Uint8Array) return body;
  if (body instanceof ArrayBuffer) return new Uint8Array(body);
  throw new TypeError('A webhook body is a string or bytes.');
}

function concat(head: Uint8Array, tail: Uint8Array): Uint8Array<ArrayBuffer> {
  const bytes = new Uint8Array(head.length + tail.length);
  bytes.set(head);
  bytes.set(tail, head.length);
  return bytes;
}

function toBase64(buffer: ArrayBuffer): string {
  let binary = '';
  for (const byte of new Uint8Array(buffer)) binary += String.fromCharCode(byte);
  return btoa(binary);
}

/** Equal strings, in a time that depends on their lengths only (a signature's length is no secret). */
function constantTimeEqual(a: string, b: string): boolean {
  if (a.length !== b.length) return false;
  let difference = 0;
  for (let i = 0; i < a.length; i++) difference |= a.charCodeAt(i) ^ b.charCodeAt(i);
  return difference === 0;
}
