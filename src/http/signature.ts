// Verifies Svc-Signature against the key's signing secret, after authentication and after the
// body has been read (the signature covers its exact bytes). The nonce of a signed POST is
// recorded later, in the same statement that stores the request, so a refused request stores
// nothing and an accepted one costs no extra commit.
import type { Config } from '../config.ts';
import { authenticationError } from '../errors.ts';
import type { KeyCache } from '../keys/cache.ts';
import { decryptSecret } from '../keys/secrets.ts';
import { signingKey, verifySignature } from '../keys/signatures.ts';
import type { Step } from './context.ts';

const NO_BODY = Buffer.alloc(0);

export function verifyRequestSignature(
  config: Pick<Config, 'signatures' | 'secretEncryptionKeys'>,
  cache: KeyCache,
): Step {
  const encryptionKeys = config.secretEncryptionKeys;
  if (encryptionKeys.length === 0) throw new Error('SECRET_ENCRYPTION_KEY is required to verify request signatures');
  return (ctx) => {
    // Absent and sent empty are told apart here (ctx.get() answers '' for both): an empty
    // header is a signature, and a malformed one, whatever SIGNATURES says.
    const header = ctx.headers['svc-signature'];
    if (header === undefined) {
      if (config.signatures === 'required') {
        throw authenticationError('missing_signature', 'The request is not signed: send the Svc-Signature header.');
      }
    } else {
      const { auth } = ctx.state;
      const key = cache.signingKey(auth, () =>
        signingKey(decryptSecret(auth.signingSecretCiphertext, auth.keyId, encryptionKeys)),
      );
      ctx.state.signature = verifySignature(Array.isArray(header) ? header.join(', ') : header, {
        method: ctx.method,
        path: ctx.originalUrl,
        body: ctx.state.body ?? NO_BODY,
      }, key);
    }
  };
}
