// The SECRET_ENCRYPTION_KEY kept under DATA_DIR when none is set (src/local.ts): commands started
// at once on a new DATA_DIR (`make run` beside `gateway keys create`, say) must all use the one
// key that ends up on disk, or the secrets one of them encrypted could never be read again.
import { mkdtemp, readdir, readFile, rm, stat } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import t from 'tap';
import { loadConfig } from '../src/config.ts';
import { withLocalSecrets } from '../src/local.ts';

t.test('commands started at once on a new DATA_DIR agree on one key, the one kept on disk', async (t) => {
  const dataDir = await mkdtemp(path.join(tmpdir(), 'gateway-local-secrets-'));
  t.teardown(() => rm(dataDir, { recursive: true, force: true }));
  const config = loadConfig({ DATA_DIR: dataDir });
  t.same(config.secretEncryptionKeys, [], 'no key set');

  const configs = await Promise.all(Array.from({ length: 8 }, () => withLocalSecrets(config)));
  const file = path.join(dataDir, 'secret-encryption-key');
  const onDisk = Buffer.from((await readFile(file, 'utf8')).trim(), 'base64');
  t.equal(onDisk.length, 32, 'a 32-byte key on disk');
  t.ok(configs.every((each) => each.secretEncryptionKeys.length === 1 && each.secretEncryptionKeys[0]!.equals(onDisk)), 'every command uses it');
  t.equal((await stat(file)).mode & 0o777, 0o600, 'readable by its owner only');
  t.same(await readdir(dataDir), ['secret-encryption-key'], 'nothing else left beside it');

  const later = await withLocalSecrets(config);
  t.ok(later.secretEncryptionKeys[0]!.equals(onDisk), 'a command started later reads it');
});
