// Request signatures (docs/signing.md):
//   Svc-Signature: t=<unix seconds>,n=<nonce>,v1=<hex HMAC-SHA256>
// over the six lines "v1", t, n, METHOD, path and query, SHA-256 hex of the body bytes, keyed
// with the signing secret's UTF-8 bytes.
import { createHmac, createSecretKey, hash, type KeyObject, timingSafeEqual } from 'node:crypto';
import { stringToSign } from '../client/signing.ts';
import { authenticationError } from '../errors.ts';

export const SIGNATURE_WINDOW_SECONDS = 300;
const HEADER = /^t=(\d{1,12}),n=([A-Za-z0-9_-]{16,64}),v1=([0-9a-f]{64})$/;

export interface SignedRequest {
  method: string;
  /** Path and query as sent, e.g. /v1/requests/req_123?x=1 */
  path: string;
  body: Buffer;
}

export interface VerifiedSignature {
  timestamp: number;
  nonce: string;
}

/** The HMAC key of a signing secret (its UTF-8 bytes); worth keeping: preparing it is costly. */
export const signingKey = (signingSecret: string): KeyObject => createSecretKey(Buffer.from(signingSecret, 'utf8'));

/** Checks a Svc-Signature header; throws the contract's 401 for each way it can be wrong. */
export function verifySignature(
  header: string,
  request: SignedRequest,
  key: KeyObject,
  nowSeconds = Math.floor(Date.now() / 1000),
): VerifiedSignature {
  const match = HEADER.exec(header.trim());
  if (!match) {
    throw authenticationError('invalid_signature', 'The Svc-Signature header is malformed: expected t=<seconds>,n=<nonce>,v1=<hex>.');
  }
  const sentTimestamp = match[1]!;
  const timestamp = Number(sentTimestamp);
  const nonce = match[2]!;
  // t is signed exactly as sent: a client that sends t=0179... signed those digits, leading zero and all.
  const signed = stringToSign({
    timestamp: sentTimestamp,
    nonce,
    method: request.method,
    path: request.path,
    bodySha256: hash('sha256', request.body),
  });
  const expected = createHmac('sha256', key).update(signed).digest();
  if (!timingSafeEqual(expected, Buffer.from(match[3]!, 'hex'))) {
    throw authenticationError('invalid_signature', 'The request signature does not match.');
  }
  if (Math.abs(nowSeconds - timestamp) > SIGNATURE_WINDOW_SECONDS) {
    throw authenticationError(
      'signature_expired',
      `The signature's timestamp is more than ${SIGNATURE_WINDOW_SECONDS} seconds from the server's clock.`,
    );
  }
  return { timestamp, nonce };
}

export const replayedRequest = () =>
  authenticationError('replayed_request', 'This signature nonce was already used; sign every request with a new one.');
