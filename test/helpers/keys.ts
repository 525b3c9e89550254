// Keys a test chooses itself, stored as `gateway keys create` stores the keys it draws.
import type { Db } from '../../src/db/pool.ts';
import { hasNoChecksum, mayBeIssuedApiKey, newKeyId, newSigningSecret, type KeyMode } from '../../src/ids.ts';
import { ensureProject, insertApiKey } from '../../src/keys/repository.ts';
import type { CreatedKey } from '../../src/keys/service.ts';
import { encryptSecret, hashApiKey } from '../../src/keys/secrets.ts';
import type { TestGateway } from './gateway.ts';

/** A test key with the given API key (createKey draws one at random), stored as createKey stores one. */
export async function createKnownKey(gateway: TestGateway, apiKey: string): Promise<CreatedKey> {
  return storeKnownKey(gateway.db, gateway.config.secretEncryptionKeys[0]!, { apiKey, project: 'test-project', mode: 'test' });
}

/**
 * A key with the given API key, stored in the database of `db`. One of the form before checksums
 * (40 characters after the prefix) is stored as a gateway of that time stored it.
 */
export async function storeKnownKey(
  db: Db,
  encryptionKey: Buffer,
  key: { apiKey: string; project: string; mode: KeyMode },
): Promise<CreatedKey> {
  const id = newKeyId();
  const signingSecret = newSigningSecret();
  const projectId = await ensureProject(db, key.project);
  await insertApiKey(db, {
    id,
    project_id: projectId,
    mode: key.mode,
    key_sha256: hashApiKey(key.apiKey),
    key_hint: key.apiKey.slice(-4),
    signing_secret_ciphertext: encryptSecret(signingSecret, id, encryptionKey),
    checksummed: mayBeIssuedApiKey(key.apiKey) && !hasNoChecksum(key.apiKey),
  });
  return { id, project: key.project, mode: key.mode, api_key: key.apiKey, signing_secret: signingSecret };
}
