// Signing requests the way docs/signing.md describes, written out independently of the
// server's verifier so that each checks the other.
import { createHash, createHmac, randomBytes } from 'node:crypto';

export interface SignatureParts {
  secret: string;
  method: string;
  /** Path and query as sent. */
  path: string;
  body?: string | Buffer;
  /** Unix seconds; a string is sent (and signed) as it is, e.g. with a leading zero. */
  timestamp?: number | string;
  nonce?: string;
}

export const newNonce = () => randomBytes(18).toString('base64url');

export function signature(parts: SignatureParts): string {
  const timestamp = parts.timestamp ?? Math.floor(Date.now() / 1000);
  const nonce = parts.nonce ?? newNonce();
  const body = parts.body ?? '';
  const lines = [
    'v1',
    String(timestamp),
    nonce,
    parts.method.toUpperCase(),
    parts.path,
    createHash('sha256').update(body).digest('hex'),
  ];
  const hex = createHmac('sha256', Buffer.from(parts.secret, 'utf8')).update(lines.join('\n')).digest('hex');
  return `t=${timestamp},n=${nonce},v1=${hex}`;
}
