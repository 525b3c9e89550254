// A real gateway for a test: its own database, real HTTP on a loopback port, the worker in
// the same process (or not, by role), and its logs kept in memory for inspection.
import { createHash } from 'node:crypto';
import { Writable } from 'node:stream';
import type pg from 'pg';
import { loadConfig, type Config } from '../../src/config.ts';
import { createDb, createPool, type Db } from '../../src/db/pool.ts';
import type { KeyMode } from '../../src/ids.ts';
import { createKey, type CreatedKey } from '../../src/keys/service.ts';
import { createLogger } from '../../src/logger.ts';
import { startGateway, type Role } from '../../src/main.ts';
import type { KeyCache } from '../../src/keys/cache.ts';
import type { UnchecksummedKeys } from '../../src/keys/unchecksummed.ts';
import type { Waiters } from '../../src/requests/waiters.ts';
import { createTestDatabase } from './database.ts';
import type { Teardown } from './teardown.ts';

export interface TestGateway {
  /** Base URL of the API (undefined for role "worker"). */
  url: string;
  /** Base URL of its METRICS_PORT server ('' unless METRICS_PORT is set: give '0' for a free port). */
  metricsUrl: string;
  databaseUrl: string;
  config: Config;
  /** A pool of the test's own, for reading and arranging rows. */
  pool: pg.Pool;
  db: Db;
  /** Every log line written so far, as JSON text. */
  logs: string[];
  /** The in-memory waiters of the API (undefined for role "worker"). */
  waiters: Waiters | undefined;
  /** The API's key cache (undefined for role "worker"). */
  keys: KeyCache | undefined;
  /** Whether the API may meet a key without a checksum (undefined for role "worker"). */
  unchecksummed: UnchecksummedKeys | undefined;
  /** A key as `gateway keys create` makes it (deadlineMs: its --deadline). */
  createKey(options?: { mode?: KeyMode; project?: string; deadlineMs?: number }): Promise<CreatedKey>;
  stop(): Promise<void>;
}

/** Settings that keep tests quick: short waits, fast retries, frequent polling. */
export const TEST_SETTINGS: Record<string, string> = {
  PORT: '0',
  HOST: '127.0.0.1',
  LOG_LEVEL: 'info',
  WAIT_TIMEOUT_MS: '3000',
  UPSTREAM_TIMEOUT_MS: '2000',
  RETRY_BASE_MS: '10',
  RETRY_MAX_MS: '40',
  WORKER_POLL_INTERVAL_MS: '50',
  WORKER_CONCURRENCY: '16',
  // Below the shortest WORKER_DEAD_AFTER_MS a test gives (it must be).
  SHUTDOWN_GRACE_MS: '500',
  // Nothing in a test may reach a real provider.
  UPSTREAM_BASE_URL: 'http://127.0.0.1:9/v1',
};

export async function startTestGateway(
  t: Teardown,
  options: { env?: Record<string, string>; role?: Role; databaseUrl?: string } = {},
): Promise<TestGateway> {
  const databaseUrl = options.databaseUrl ?? (await createTestDatabase(t));
  const config = loadConfig({
    ...TEST_SETTINGS,
    // Every gateway of one test database shares its key, as the processes of one deployment do.
    SECRET_ENCRYPTION_KEY: createHash('sha256').update(`test key for ${databaseUrl}`).digest('base64'),
    ...options.env,
    DATABASE_URL: databaseUrl,
  });
  const logs: string[] = [];
  const sink = new Writable({
    write(chunk: Buffer, _encoding, done) {
      logs.push(...chunk.toString('utf8').split('\n').filter(Boolean));
      done();
    },
  });
  const logger = createLogger(config, sink);
  const gateway = await startGateway({ config, logger, role: options.role ?? 'all', databaseUrl });
  const pool = createPool(databaseUrl, { max: 4, applicationName: 'gateway-test', logger });
  const db = createDb(pool);

  let stopped = false;
  const stop = async () => {
    if (stopped) return;
    stopped = true;
    await gateway.stop();
  };
  t.teardown(async () => {
    await stop();
    await pool.end();
  });

  return {
    url: gateway.url ?? '',
    metricsUrl: gateway.metricsUrl,
    databaseUrl,
    config,
    pool,
    db,
    logs,
    waiters: gateway.waiters,
    keys: gateway.keys,
    unchecksummed: gateway.unchecksummed,
    createKey: (keyOptions = {}) =>
      createKey(db, config.secretEncryptionKeys[0], {
        project: keyOptions.project ?? 'test-project',
        mode: keyOptions.mode ?? 'test',
        deadlineMs: keyOptions.deadlineMs,
      }),
    stop,
  };
}
