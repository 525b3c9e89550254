// Running from a checkout with nothing set up: when DATABASE_URL is unset, the database is an
// embedded Postgres under DATA_DIR, and SECRET_ENCRYPTION_KEY, when unset too, is generated
// once and kept beside it. Production deployments set both and never reach this file.
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { mkdir, readFile, writeFile } from 'node:fs/promises';
import path from 'node:path';
import type { Config } from './config.ts';
import { startEmbeddedPostgres } from './db/embedded.ts';
import type { Logger } from './logger.ts';

export interface LocalDatabase {
  url: string;
  /** true when this is the embedded Postgres under DATA_DIR. */
  embedded: boolean;
  /** Stops the embedded Postgres if this process started it. */
  release(): Promise<void>;
}

export async function openDatabase(config: Config, logger: Logger): Promise<LocalDatabase> {
  if (config.databaseUrl !== undefined) {
    return { url: config.databaseUrl, embedded: false, release: async () => {} };
  }
  const cluster = await startEmbeddedPostgres({
    directory: path.join(config.dataDir, 'postgres'),
    port: config.embeddedPostgresPort,
    logger,
    durable: true,
  });
  return { url: cluster.url, embedded: true, release: () => cluster.stop() };
}

/** The config, with a SECRET_ENCRYPTION_KEY kept under DATA_DIR when none is set. */
export async function withLocalSecrets(config: Config): Promise<Config> {
  if (config.secretEncryptionKeys.length > 0) return config;
  const file = path.join(config.dataDir, 'secret-encryption-key');
  let key: Buffer;
  if (existsSync(file)) {
    key = Buffer.from((await readFile(file, 'utf8')).trim(), 'base64');
  } else {
    key = randomBytes(32);
    await mkdir(config.dataDir, { recursive: true });
    await writeFile(file, `${key.toString('base64')}\n`, { mode: 0o600 });
  }
  return Object.freeze({ ...config, secretEncryptionKeys: Object.freeze([key]) });
}
