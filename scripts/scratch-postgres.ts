// The Postgres server the project's scripts work on (the test harness, `npm run db:types`):
// DATABASE_URL's, or, when it is unset, an embedded one under .data/test-postgres, started here
// and stopped by stop().
import path from 'node:path';
import type { Config } from '../src/config.ts';
import { startEmbeddedPostgres } from '../src/db/embedded.ts';
import type { Logger } from '../src/logger.ts';
import { freePort } from './ports.ts';

export interface ScriptPostgres {
  /** A URL of the server with rights to create and drop databases. */
  adminUrl: string;
  /** Stops the embedded server, if one was started; nothing otherwise. */
  stop(): Promise<void>;
}

export async function scriptPostgres(config: Pick<Config, 'databaseUrl' | 'dataDir'>, logger: Logger): Promise<ScriptPostgres> {
  if (config.databaseUrl !== undefined) return { adminUrl: config.databaseUrl, stop: async () => {} };
  const cluster = await startEmbeddedPostgres({
    directory: path.join(config.dataDir, 'test-postgres'),
    port: await freePort(),
    logger,
    durable: false,
  });
  return { adminUrl: cluster.url, stop: () => cluster.stop() };
}
