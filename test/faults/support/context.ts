// One fault scenario's world: a database of its own (a clone of the run's template, or one the
// scenario brings, such as its own embedded Postgres), a pool for reading rows, keys whose
// secrets are recorded for the log search, and the gateway processes it starts. At teardown
// the processes are killed first, then the pool is closed and the database dropped (or what
// the scenario gave as `afterwards` is done, such as stopping its Postgres).
import { randomBytes } from 'node:crypto';
import type pg from 'pg';
import type { Test } from 'tap';
import { createDb, createPool, type Db } from '../../../src/db/pool.ts';
import type { KeyMode } from '../../../src/ids.ts';
import { createKey, type CreatedKey } from '../../../src/keys/service.ts';
import { createLogger } from '../../../src/logger.ts';
import { addEndpoint, type CreatedEndpoint } from '../../../src/webhooks/endpoints.ts';
import type { Role } from '../../../src/main.ts';
import { createTestDatabase } from '../../helpers/database.ts';
import { searchLogs } from './logs.ts';
import { freePort } from '../../helpers/ports.ts';
import { GatewayProcess } from '../../helpers/serve.ts';
import { logFile, logFiles, markLogsClean, recordSecret, runDirectory, UPSTREAM_API_KEY } from './run.ts';
import type { Teardown } from '../../helpers/teardown.ts';

/** Settings every process of the suite starts with; scenarios override what they need. */
export const FAULT_SETTINGS: Record<string, string> = {
  HOST: '127.0.0.1',
  LOG_LEVEL: 'info',
  WAIT_TIMEOUT_MS: '10000',
  // Nothing may reach a real provider: live keys call a loopback server or nothing at all.
  UPSTREAM_BASE_URL: 'http://127.0.0.1:9/v1',
  UPSTREAM_API_KEY,
  UPSTREAM_TIMEOUT_MS: '2000',
  MAX_ATTEMPTS: '5',
  RETRY_BASE_MS: '10',
  RETRY_MAX_MS: '100',
  WORKER_POLL_INTERVAL_MS: '100',
  WORKER_CONCURRENCY: '32',
  // WORKER_DEAD_AFTER_MS is the default: a dead worker's attempts start again within 10 s.
  SHUTDOWN_GRACE_MS: '2000',
  DATABASE_POOL_SIZE: '8',
  WORKER_POOL_SIZE: '8',
};

export interface FaultContext {
  scenario: string;
  databaseUrl: string;
  /** SECRET_ENCRYPTION_KEY of every process of the scenario. */
  encryptionKey: Buffer;
  /** The test's own pool and kysely instance, for reading and arranging rows. */
  pool: pg.Pool;
  db: Db;
  createKey(options: { project: string; mode: KeyMode; deadlineMs?: number }): Promise<CreatedKey>;
  /** A webhook endpoint of the project (private addresses allowed), its secret recorded for the log search. */
  addEndpoint(options: { project: string; url: string }): Promise<CreatedEndpoint>;
  /** A gateway process with the suite's settings plus `env`; not started yet. */
  process(role: Role, options?: { label?: string; env?: Record<string, string> }): Promise<GatewayProcess>;
  /** The same, started. */
  start(role: Role, options?: { label?: string; env?: Record<string, string> }): Promise<GatewayProcess>;
  /**
   * The end of every scenario: its processes are stopped (SIGTERM, then SIGKILL), and the logs
   * of the run so far (its own, and those of the scenarios that ran before or beside it)
   * searched for keys, secrets, the upstream key and message contents. Scenarios run side by
   * side, so each log and each secret recorded meet in the search of whichever of their two
   * scenarios ends last; scenario 6 searches them all again.
   */
  finish(t: Test): Promise<void>;
}

export async function faultContext(
  t: Teardown,
  scenario: string,
  options: { databaseUrl?: string; afterwards?: () => Promise<void> } = {},
): Promise<FaultContext> {
  const cleanups: (() => Promise<void> | void)[] = [];
  if (options.afterwards) cleanups.push(options.afterwards);
  const databaseUrl =
    options.databaseUrl ?? (await createTestDatabase({ teardown: (fn) => cleanups.push(fn) }));
  const encryptionKey = randomBytes(32);
  const logger = createLogger({ logLevel: 'error' }, process.stderr);
  const pool = createPool(databaseUrl, { max: 4, applicationName: `faults-${scenario}`, logger });
  const db = createDb(pool);
  const processes: GatewayProcess[] = [];

  t.teardown(async () => {
    await Promise.all(processes.map((gateway) => gateway.destroy()));
    await pool.end();
    for (const cleanup of cleanups) await cleanup();
  });

  const make = async (role: Role, processOptions: { label?: string; env?: Record<string, string> } = {}) => {
    const label = processOptions.label ?? role;
    if (processes.some((existing) => existing.label === label)) throw new Error(`two processes named ${label}`);
    const gateway = new GatewayProcess({
      label,
      args: ['--role', role],
      logFile: logFile(scenario, label),
      env: {
        PATH: process.env.PATH ?? '',
        ...(process.env.HOME ? { HOME: process.env.HOME } : {}),
        ...(process.env.NODE_COMPILE_CACHE ? { NODE_COMPILE_CACHE: process.env.NODE_COMPILE_CACHE } : {}),
        ...FAULT_SETTINGS,
        PORT: role === 'worker' ? '0' : String(await freePort()),
        ...processOptions.env,
        DATABASE_URL: databaseUrl,
        SECRET_ENCRYPTION_KEY: encryptionKey.toString('base64'),
      },
    });
    processes.push(gateway);
    return gateway;
  };

  return {
    scenario,
    databaseUrl,
    encryptionKey,
    pool,
    db,
    async createKey(keyOptions) {
      const key = await createKey(db, encryptionKey, keyOptions);
      recordSecret(scenario, 'api_key', key.api_key);
      recordSecret(scenario, 'signing_secret', key.signing_secret);
      return key;
    },
    async addEndpoint(endpointOptions) {
      const endpoint = await addEndpoint(db, { encryptionKey, allowPrivate: true }, endpointOptions);
      // As it is given, and without its prefix: what signs the deliveries.
      recordSecret(scenario, 'webhook_secret', endpoint.secret);
      recordSecret(scenario, 'webhook_secret', endpoint.secret.slice('whsec_'.length));
      return endpoint;
    },
    process: make,
    async start(role, processOptions) {
      const gateway = await make(role, processOptions);
      await gateway.start();
      return gateway;
    },
    async finish(t) {
      await Promise.all(processes.map((gateway) => gateway.stop()));
      const search = searchLogs(logFiles());
      const others = [...search.linesByScenario.keys()].filter((name) => name !== scenario);
      t.comment(`searched the ${search.files} logs of this scenario (${search.linesByScenario.get(scenario) ?? 0} lines) and of ${others.join(', ') || 'no other'} for ${search.secretsSearched} recorded keys and secrets, the upstream key and message contents`);
      t.ok(search.linesByScenario.has(scenario), 'the logs of this scenario were among them');
      t.same(search.leaks.slice(0, 20), [], `the logs of every process this scenario (and those before or beside it) started hold no key, secret, upstream key or message content (${search.leaks.length} found)`);
      // Kept for whoever looks into a failure; otherwise gone once every scenario is done.
      if (search.leaks.length === 0 && t.passing()) markLogsClean(scenario);
      else t.comment(`the logs are kept in ${runDirectory()}`);
    },
  };
}
