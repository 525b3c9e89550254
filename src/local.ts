// Running from a checkout with nothing set up: when DATABASE_URL is unset, the database is an
// embedded Postgres under DATA_DIR, and SECRET_ENCRYPTION_KEY, when unset too, is generated
// once and kept beside it. Production deployments set both and never reach this file.
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { link, mkdir, readFile, unlink, writeFile } from 'node:fs/promises';
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
  /**
   * The process's shutdown handles SIGINT and SIGTERM from now on, and calls release(): until
   * then, either stops the embedded Postgres this process started and ends the process.
   */
  shutdownHandled(): void;
}

/**
 * DATABASE_URL's database, or the embedded Postgres under DATA_DIR: `serves` for `gateway start`,
 * which refuses an embedded Postgres another gateway runs (embedded.ts).
 */
export async function openDatabase(config: Config, logger: Logger, options: { serves: boolean }): Promise<LocalDatabase> {
  if (config.databaseUrl !== undefined) {
    return { url: config.databaseUrl, embedded: false, release: async () => {}, shutdownHandled: () => {} };
  }
  const cluster = await startEmbeddedPostgres({
    directory: path.join(config.dataDir, 'postgres'),
    port: config.embeddedPostgresPort,
    logger,
    durable: true,
    serves: options.serves,
  });
  return { url: cluster.url, embedded: true, release: () => cluster.stop(), shutdownHandled: () => cluster.shutdownHandled() };
}

/** The config, with a SECRET_ENCRYPTION_KEY kept under DATA_DIR when none is set. */
export async function withLocalSecrets(config: Config): Promise<Config> {
  if (config.secretEncryptionKeys.length > 0) return config;
  const file = path.join(config.dataDir, 'secret-encryption-key');
  let key: Buffer;
  if (existsSync(file)) {
    key = await readKey(file);
  } else {
    key = randomBytes(32);
    await mkdir(config.dataDir, { recursive: true });
    // Written whole beside it, then linked in place only if no key is there: two commands started
    // at once on a new DATA_DIR must not each keep a key of their own, the last one written over
    // the first (whose secrets it encrypted could never be read again), nor read one half written.
    const written = `${file}.${process.pid}.${randomBytes(6).toString('hex')}`;
    await writeFile(written, `${key.toString('base64')}\n`, { mode: 0o600, flag: 'wx' });
    try {
      await link(written, file);
    } catch (error) {
      if ((error as { code?: string }).code !== 'EEXIST') throw error;
      key = await readKey(file);
    } finally {
      await unlink(written);
    }
  }
  return Object.freeze({ ...config, secretEncryptionKeys: Object.freeze([key]) });
}

async function readKey(file: string): Promise<Buffer> {
  return Buffer.from((await readFile(file, 'utf8')).trim(), 'base64');
}
