// Keys a test chooses itself, stored as `gateway keys create` stores the keys it draws.
import { newKeyId, newSigningSecret } from '../../src/ids.ts';
import { ensureProject, insertApiKey } from '../../src/keys/repository.ts';
import type { CreatedKey } from '../../src/keys/service.ts';
import { encryptSecret, hashApiKey } from '../../src/keys/secrets.ts';
import type { TestGateway } from './gateway.ts';

/** A test key with the given API key (createKey draws one at random), stored as createKey stores one. */
export async function createKnownKey(gateway: TestGateway, apiKey: string): Promise<CreatedKey> {
  const id = newKeyId();
  const signingSecret = newSigningSecret();
  const projectId = await ensureProject(gateway.db, 'test-project');
  await insertApiKey(gateway.db, {
    id,
    project_id: projectId,
    mode: 'test',
    key_sha256: hashApiKey(apiKey),
    key_hint: apiKey.slice(-4),
    signing_secret_ciphertext: encryptSecret(signingSecret, id, gateway.config.secretEncryptionKeys[0]!),
  });
  return { id, project: 'test-project', mode: 'test', api_key: apiKey, signing_secret: signingSecret };
}
