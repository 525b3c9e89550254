// How keys and signing secrets are kept: API keys only as SHA-256 (they are long random
// strings, so a plain hash cannot be reversed by guessing), signing secrets (and webhook
// endpoints' secrets) encrypted with AES-256-GCM under the server's encryption key, bound to
// their owner's id. While keys are being rotated (SECRET_ENCRYPTION_KEYS), the first key
// encrypts and any of them decrypts.
import { createCipheriv, createDecipheriv, hash, randomBytes } from 'node:crypto';

const FORMAT_VERSION = 1;
const IV_BYTES = 12;
const TAG_BYTES = 16;

export function hashApiKey(apiKey: string): Buffer {
  return hash('sha256', apiKey, 'buffer');
}

/** version (1 byte) | iv (12) | GCM tag (16) | ciphertext; the owner's id is the associated data. */
export function encryptSecret(secret: string, ownerId: string, encryptionKey: Buffer): Buffer {
  const iv = randomBytes(IV_BYTES);
  const cipher = createCipheriv('aes-256-gcm', encryptionKey, iv);
  cipher.setAAD(Buffer.from(ownerId, 'utf8'));
  const ciphertext = Buffer.concat([cipher.update(secret, 'utf8'), cipher.final()]);
  return Buffer.concat([Buffer.of(FORMAT_VERSION), iv, cipher.getAuthTag(), ciphertext]);
}

/**
 * The secret, decrypted with the first of the keys that can (GCM's tag tells a wrong key
 * apart); throws when none can.
 */
export function decryptSecret(sealed: Buffer, ownerId: string, keys: readonly Buffer[]): string {
  for (const key of keys) {
    const secret = decryptWith(sealed, ownerId, key);
    if (secret !== undefined) return secret;
  }
  throw new Error(`the secret of ${ownerId} cannot be decrypted with ${keys.length === 1 ? 'this key' : `any of these ${keys.length} keys`}`);
}

/** The secret, or undefined when this is not the key it was encrypted with. */
export function decryptWith(sealed: Buffer, ownerId: string, encryptionKey: Buffer): string | undefined {
  if (sealed[0] !== FORMAT_VERSION) throw new Error('unknown secret format');
  const iv = sealed.subarray(1, 1 + IV_BYTES);
  const tag = sealed.subarray(1 + IV_BYTES, 1 + IV_BYTES + TAG_BYTES);
  const decipher = createDecipheriv('aes-256-gcm', encryptionKey, iv);
  decipher.setAAD(Buffer.from(ownerId, 'utf8'));
  decipher.setAuthTag(tag);
  try {
    return Buffer.concat([decipher.update(sealed.subarray(1 + IV_BYTES + TAG_BYTES)), decipher.final()]).toString('utf8');
  } catch {
    return undefined;
  }
}
