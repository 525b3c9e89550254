// A Postgres of the scenario's own, which it may stop and start again: an embedded cluster in
// .data/faults-<random> on a free port (never the machine's Postgres, nor the test harness's),
// migrated, and deleted at the end. Its own log goes to the run's log directory with the
// gateway processes' logs.
import { rm } from 'node:fs/promises';
import path from 'node:path';
import { Writable } from 'node:stream';
import { startEmbeddedPostgres, type EmbeddedPostgres } from '../../../src/db/embedded.ts';
import { migrate } from '../../../src/db/migrate.ts';
import { createPool } from '../../../src/db/pool.ts';
import { randomBase62 } from '../../../src/ids.ts';
import { createLogger } from '../../../src/logger.ts';
import { freePort } from '../../helpers/ports.ts';
import { appendToLog } from '../../helpers/serve.ts';
import { logFile } from './run.ts';

const ROOT = new URL('../../../', import.meta.url).pathname;

export interface DedicatedPostgres {
  /** Connection string of its "postgres" database. */
  url: string;
  readonly running: boolean;
  /** A fast shutdown, as `pg_ctl stop` does: sessions are ended, and it is gone once this resolves. */
  stop(): Promise<void>;
  /** Starts it again on the same directory and port. */
  start(): Promise<void>;
  /** Stops it if it runs, and deletes its directory. */
  remove(): Promise<void>;
}

export async function dedicatedPostgres(scenario: string): Promise<DedicatedPostgres> {
  const directory = path.join(ROOT, '.data', `faults-${randomBase62(12).toLowerCase()}`);
  const port = await freePort();
  const file = logFile(scenario, 'postgres');
  const logger = createLogger(
    { logLevel: 'debug' },
    new Writable({
      write(chunk: Buffer, _encoding, done) {
        appendToLog(file, chunk);
        done();
      },
    }),
  );
  const options = { directory, port, logger, durable: false };
  let cluster: EmbeddedPostgres | undefined = await startEmbeddedPostgres(options);
  const url = cluster.url;

  const pool = createPool(url, { max: 2, applicationName: 'faults-migrate', logger });
  await migrate(pool, logger).finally(() => pool.end());

  return {
    url,
    get running() {
      return cluster !== undefined;
    },
    async stop() {
      await cluster?.stop();
      cluster = undefined;
    },
    async start() {
      if (cluster) throw new Error('the dedicated Postgres is already running');
      cluster = await startEmbeddedPostgres(options);
    },
    async remove() {
      await cluster?.stop();
      cluster = undefined;
      await rm(directory, { recursive: true, force: true });
      await rm(`${directory}.json`, { force: true });
    },
  };
}
