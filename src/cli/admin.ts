// The administrative commands of the command line (keys, webhooks, requests, stats, upstreams,
// usage, migrate): each runs on a database opened for it, and loads nothing of the API or the
// worker (cli.ts imports those only for serve and start).
import type pg from 'pg';
import type { Config } from '../config.ts';
import { assertSchemaCurrent } from '../db/migrate.ts';
import { createDb, createPool, type Db } from '../db/pool.ts';
import { openDatabase, withLocalSecrets } from '../local.ts';
import { createLogger, type Logger } from '../logger.ts';

export interface AdminContext {
  pool: pg.Pool;
  logger: Logger;
  /** The config, with the embedded database's SECRET_ENCRYPTION_KEY when that is used. */
  config: Config;
}

/** An administrative command: what it prints. */
export type AdminCommand = (db: Db, context: AdminContext) => Promise<string>;

/**
 * Runs one administrative command against the database and prints what it returns. Logs go to
 * stderr, so that stdout (for --json) carries only the answer. With DATABASE_URL unset, the
 * embedded Postgres under DATA_DIR is used (started for the command if it is not running).
 * Unless it is `migrate` (`anySchema`), a command refuses a database whose schema is not this
 * code's, saying what to run, rather than failing on a table or column it does not find.
 */
export async function runAdminCommand(config: Config, command: AdminCommand, options: { anySchema?: boolean } = {}): Promise<void> {
  const logger = createLogger({ logLevel: config.logLevel === 'info' ? 'warn' : config.logLevel }, process.stderr);
  const database = await openDatabase(config, logger);
  const effective = database.embedded ? await withLocalSecrets(config) : config;
  const pool = createPool(database.url, { max: 2, applicationName: 'gateway-cli', logger });
  try {
    if (!options.anySchema) await assertSchemaCurrent(pool);
    console.log(await command(createDb(pool), { pool, logger, config: effective }));
  } finally {
    await pool.end();
    await database.release();
  }
}
