// How keys and signing secrets are kept: API keys only as SHA-256 (they are long random
// strings, so a plain hash cannot be reversed by guessing), signing secrets encrypted with
// AES-256-GCM under the server's SECRET_ENCRYPTION_KEY, bound to their key id.
import { createCipheriv, createDecipheriv, hash, randomBytes } from 'node:crypto';

const FORMAT_VERSION = 1;
const IV_BYTES = 12;
const TAG_BYTES = 16;

export function hashApiKey(apiKey: string): Buffer {
  return hash('sha256', apiKey, 'buffer');
}

/** version (1 byte) | iv (12) | GCM tag (16) | ciphertext; the key id is the associated data. */
export function encryptSecret(secret: string, keyId: string, encryptionKey: Buffer): Buffer {
  const iv = randomBytes(IV_BYTES);
  const cipher = createCipheriv('aes-256-gcm', encryptionKey, iv);
  cipher.setAAD(Buffer.from(keyId, 'utf8'));
  const ciphertext = Buffer.concat([cipher.update(secret, 'utf8'), cipher.final()]);
  return Buffer.concat([Buffer.of(FORMAT_VERSION), iv, cipher.getAuthTag(), ciphertext]);
}

export function decryptSecret(sealed: Buffer, keyId: string, encryptionKey: Buffer): string {
  if (sealed[0] !== FORMAT_VERSION) throw new Error('unknown signing secret format');
  const iv = sealed.subarray(1, 1 + IV_BYTES);
  const tag = sealed.subarray(1 + IV_BYTES, 1 + IV_BYTES + TAG_BYTES);
  const decipher = createDecipheriv('aes-256-gcm', encryptionKey, iv);
  decipher.setAAD(Buffer.from(keyId, 'utf8'));
  decipher.setAuthTag(tag);
  return Buffer.concat([decipher.update(sealed.subarray(1 + IV_BYTES + TAG_BYTES)), decipher.final()]).toString('utf8');
}
