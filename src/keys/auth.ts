import type { KeyMode } from '../ids.ts';

/** Who is calling: established from the bearer key before anything else is looked at. */
export interface Auth {
  keyId: string;
  projectId: string;
  mode: KeyMode;
  signingSecretCiphertext: Buffer;
  /** The key's own request deadline; undefined: REQUEST_DEADLINE. */
  requestDeadlineMs: number | undefined;
}
