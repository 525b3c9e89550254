// The composition root: the one place that builds the gateway's parts and stops them.
// - startGateway: one process's API and/or worker from a config, stopped in order: stop
//   accepting connections, answer every waiting request with its acknowledgement, let running
//   attempts finish, then close the pools.
// - serve, start, serveClusterChild: what `gateway serve` and `gateway start` run (with
//   API_PROCESSES > 1, a cluster: cluster.ts), until a signal stops them.
// - runAdminCommand: the database an administrative command of the command line runs on.
import type http from 'node:http';
import type pg from 'pg';
import { shareMetricsWithPrimary, startCluster, tellPrimaryStartFailed } from './cluster.ts';
import { ConfigError, type Config } from './config.ts';
import { assertMigrationsUnchanged, migrate, schemaVersion } from './db/migrate.ts';
import { createDb, createPool, type Db } from './db/pool.ts';
import { whileUnavailable } from './db/retry.ts';
import { createApp, createMetricsApp, createOpsApp } from './http/app.ts';
import { closeServer, listen, urlOf } from './http/server.ts';
import { createLogger, type Logger } from './logger.ts';
import { openDatabase, withLocalSecrets } from './local.ts';
import { errorCode } from './network-errors.ts';
import { Metrics } from './metrics.ts';
import { Listener } from './db/listener.ts';
import { KeyCache } from './keys/cache.ts';
import { UnchecksummedKeys } from './keys/unchecksummed.ts';
import { KeyReads } from './keys/reads.ts';
import { signingSecretNotDecrypted } from './keys/service.ts';
import { InsertBatcher } from './requests/insert-batcher.ts';
import { countUnfinishedByStatus } from './requests/inspection.ts';
import { createRequestReads } from './requests/reads.ts';
import { FINISHED_CHANNEL, Waiters } from './requests/waiters.ts';
import { QueueRouter } from './lanes/routing.ts';
import { intakeLimitsFor, NO_INTAKE_LIMITS } from './requests/intake.ts';
import { stopOnSignals } from './signals.ts';
import { createAttempts, type RecordingWaiters } from './worker/attempts.ts';
import { Dispatcher, dispatcherSettings, OWN_DISPATCH_FALLBACK_MS } from './worker/dispatcher.ts';
import { startWorkerService, type WorkerService } from './worker/supervisor.ts';
import { WebhookDeliverer } from './webhooks/deliverer.ts';
import { oldestUnfinishedMessageAge } from './webhooks/repository.ts';

export type Role = 'all' | 'api' | 'worker';

export interface GatewayOptions {
  config: Config;
  logger: Logger;
  role: Role;
  databaseUrl: string;
  /** false: serve no HTTP at all (the worker of a cluster's primary, whose API processes serve it). */
  http?: boolean;
  /** false: leave METRICS_PORT alone even when it is set (a cluster's API process: its primary serves it for all). */
  metricsPort?: boolean;
}

export interface Gateway {
  /** Base URL of its HTTP server: the API, or for role "worker" only health ('' with http: false). */
  url: string;
  /** Base URL of its METRICS_PORT server ('' when it serves none). */
  metricsUrl: string;
  metrics: Metrics;
  waiters: Waiters | undefined;
  keys: KeyCache | undefined;
  /** Whether the API's process may meet a key without a checksum (undefined for role "worker"). */
  unchecksummed: UnchecksummedKeys | undefined;
  stop(): Promise<void>;
}

/**
 * How a gateway stops, whichever of its parts were built before it stops (or before its start
 * failed). Each part is handed over as it is built; stop() then:
 * 1. tells the worker service to stop, so that calls in flight get SHUTDOWN_GRACE_MS while the
 *    HTTP servers close;
 * 2. closes the METRICS_PORT server and the main one, and answers waiting wait=true requests
 *    now with their acknowledgement, rather than holding the shutdown for up to WAIT_TIMEOUT_MS;
 * 3. once the servers are closed and the worker has stopped, stops what the parts used, in the
 *    order handed over: first what uses connections, then the connections.
 */
class Shutdown {
  worker: WorkerService | undefined;
  metricsServer: http.Server | undefined;
  server: http.Server | undefined;
  waiters: Waiters | undefined;
  /** The attempts' upstream connections, the intake counters. */
  readonly users: Array<() => Promise<void>> = [];
  /** The LISTEN connection, the pools. */
  readonly connections: Array<() => Promise<void>> = [];

  async stop(): Promise<void> {
    const workerStopped = this.worker?.stop();
    const metricsClosed = this.metricsServer && closeServer(this.metricsServer);
    const serverClosed = this.server && closeServer(this.server);
    this.waiters?.close();
    await serverClosed;
    await metricsClosed;
    await workerStopped;
    for (const step of this.users) await step();
    for (const step of this.connections) await step();
  }
}

export async function startGateway(options: GatewayOptions): Promise<Gateway> {
  const { config, logger, role, databaseUrl } = options;
  if (role !== 'worker' && config.secretEncryptionKeys.length === 0) throw noEncryptionKey();
  const metrics = new Metrics();
  const shutdown = new Shutdown();
  const stop = () => shutdown.stop();
  // The API's, once built. The worker's side is built before it, and wakes them through this.
  let waiters: Waiters | undefined;
  let keys: KeyCache | undefined;
  let unchecksummed: UnchecksummedKeys | undefined;

  try {
    // One LISTEN connection per process, for whichever of its parts need to hear: waiters and
    // the key cache, and the dispatcher (a call whose request was cancelled is aborted).
    const listener = new Listener(databaseUrl, logger);
    shutdown.connections.push(() => listener.close());
    // The worker's side first (it opens no connection yet): the API of the same process
    // dispatches the requests it accepts on it.
    const worker =
      role === 'api'
        ? undefined
        : buildWorkerSide({
            options,
            metrics,
            listener,
            shutdown,
            // In the same process, waiters hear of a completion from the worker, with its result:
            // they answer without reading it back.
            waiters: {
              recording: (id) => waiters?.recording(id),
              recorded: (id, outcome) => waiters?.recorded(id, outcome),
            },
          });
    if (role !== 'worker') {
      const apiPool = createPool(databaseUrl, { max: config.databasePoolSize, applicationName: 'gateway-api', logger });
      shutdown.connections.push(() => apiPool.end());
      await assertSchemaCurrent(apiPool);
      const db = createDb(apiPool);
      await assertSecretsDecrypt(db, config);
      waiters = new Waiters(listener);
      shutdown.waiters = waiters;
      keys = new KeyCache(listener);
      const unchecksummedKeys = new UnchecksummedKeys(db, listener, logger);
      unchecksummed = unchecksummedKeys;
      shutdown.users.push(() => unchecksummedKeys.stop());
      await listener.start();
      await unchecksummedKeys.read();
      metrics.watchPool('api', apiPool);
      metrics.watchWaiters(waiters);
      metrics.watchQueue(() => countUnfinishedByStatus(db));
      metrics.watchWebhooks(() => oldestUnfinishedMessageAge(db));
      const queues = new QueueRouter(db, config);
      const intake = intakeLimitsFor(db, config, {
        logger,
        onRefused: (mode, limit) => metrics.intakeRefused.inc({ mode, limit }),
      });
      if (intake) shutdown.users.push(() => intake.stop());
      intake?.start();
      // A worker in this process dispatches the requests this API accepts, without a queue hop.
      const dispatcher = worker?.dispatcher;
      const app = createApp({
        config,
        pool: apiPool,
        db,
        inserts: new InsertBatcher(db, {
          maxInFlight: 2,
          onGroup: (size) => metrics.insertGroupSize.observe(size),
          onDone: (seconds) => metrics.durableWrites.observe({ write: 'accept' }, seconds),
          // This process's dispatcher takes what it accepts at once; the jobs are its fallback.
          ...(dispatcher ? { dispatchDelayMs: OWN_DISPATCH_FALLBACK_MS } : {}),
        }),
        reads: createRequestReads(db),
        waiters,
        keys,
        keyReads: new KeyReads(db, { onRefused: () => metrics.keyReadsRefused.inc() }),
        unchecksummed,
        metrics,
        logger,
        queues,
        intake: intake ?? NO_INTAKE_LIMITS,
        ...(dispatcher
          ? { onStored: (queueId: string) => dispatcher.poke(queueId), reserveStart: (queueId: string) => dispatcher.reserveStart(queueId) }
          : {}),
      });
      shutdown.server = await listenOn(app.callback(), config.port, config.host, metrics);
    }
    if (worker) {
      if (role === 'worker') {
        await assertSchemaCurrent(worker.pool);
        await listener.start();
        metrics.watchQueue(() => countUnfinishedByStatus(worker.db));
        metrics.watchWebhooks(() => oldestUnfinishedMessageAge(worker.db));
        if (options.http !== false) {
          const ops = createOpsApp({ config, pool: worker.pool, metrics, logger });
          shutdown.server = await listenOn(ops.callback(), config.port, config.host, metrics);
        }
      }
      shutdown.worker = await startWorkerService({ config, metrics, logger, ...worker });
    }
    if (options.http !== false && options.metricsPort !== false && config.metricsPort !== undefined) {
      shutdown.metricsServer = await listenForMetrics(config, metrics, logger);
    }
  } catch (error) {
    await stop().catch(() => {});
    throw error;
  }

  const url = urlOf(shutdown.server);
  const metricsUrl = urlOf(shutdown.metricsServer);
  logger.info({ role, url, ...(metricsUrl ? { metricsUrl } : {}) }, 'gateway started');
  return { url, metricsUrl, metrics, waiters, keys, unchecksummed, stop };
}

/**
 * The worker's parts: its pool, the attempts, the dispatcher that runs them and the webhook
 * deliverer. It opens no connection yet; startWorkerService runs them.
 */
function buildWorkerSide(parts: {
  options: GatewayOptions;
  metrics: Metrics;
  listener: Listener;
  shutdown: Shutdown;
  waiters: RecordingWaiters;
}) {
  const { options, metrics, listener, shutdown, waiters } = parts;
  const { config, logger } = options;
  const pool = createPool(options.databaseUrl, { max: config.workerPoolSize, applicationName: 'gateway-worker', logger });
  shutdown.connections.push(() => pool.end());
  const db = createDb(pool);
  metrics.watchPool('worker', pool);
  const attempts = createAttempts({ db, config, metrics, logger, waiters });
  shutdown.users.push(() => attempts.close());
  const dispatcher = new Dispatcher({ db, attempts, ...dispatcherSettings(config), metrics, logger });
  metrics.watchDispatcher(dispatcher);
  const deliverer = new WebhookDeliverer({ db, config, workerId: dispatcher.workerId, metrics, logger });
  // It looks for forgotten tries from the start (a timer): a start that fails before the worker
  // service runs (and stops it) must stop it, or it would go on looking on the closed pool.
  shutdown.users.push(() => deliverer.stop());
  listener.subscribe(FINISHED_CHANNEL, {
    notification: (payload) => dispatcher.ended(payload.split(',')),
    lost: () => dispatcher.hearing(false),
    restored: () => dispatcher.hearing(true),
  });
  return { pool, db, attempts, dispatcher, deliverer };
}

/** GET /metrics on METRICS_PORT. */
function listenForMetrics(config: Config, metrics: Metrics, logger: Logger): Promise<http.Server> {
  return listenOn(createMetricsApp({ config, metrics, logger }).callback(), config.metricsPort!, config.host, metrics);
}

/**
 * listen(), whose failure stops the start, saying why: a HOST that does not resolve fails with
 * getaddrinfo's ENOTFOUND or EAI_AGAIN, which a start would otherwise take for its database out
 * of reach (whenAvailable) and try again for good. A port in use is said by the command line.
 * The answers the server gives before the app (http/server.ts) are counted as the app's are,
 * with no route matched.
 */
async function listenOn(handler: http.RequestListener, port: number, host: string, metrics: Metrics): Promise<http.Server> {
  try {
    return await listen(handler, port, host, (method, status) => metrics.httpRequests.inc({ method, route: 'unmatched', status: String(status) }));
  } catch (error) {
    if (errorCode(error) === 'EADDRINUSE') throw error;
    throw new ConfigError(`Cannot listen on HOST ${host}, port ${port}: ${(error as Error).message}.`);
  }
}

/** `gateway serve`: the role given, as a cluster of API processes when API_PROCESSES > 1. */
export async function serve(config: Config, role: Role, databaseUrl: string): Promise<void> {
  const logger = createLogger(config);
  const running = await startRole({ config, logger, role, databaseUrl, childEnv: {} });
  stopOnSignals(() => running.stop(), logger);
}

/** The role given, as a cluster of API processes when API_PROCESSES > 1 (a worker alone never is one). */
function startRole(options: {
  config: Config;
  logger: Logger;
  role: Role;
  databaseUrl: string;
  /** Settings the API processes of a cluster need that this process made up. */
  childEnv: Record<string, string>;
}): Promise<{ stop(): Promise<void> }> {
  const { config, logger, role, databaseUrl, childEnv } = options;
  return config.apiProcesses > 1 && role !== 'worker'
    ? startApiCluster({ config, logger, role, databaseUrl, childEnv })
    : whenAvailable(() => startGateway({ config, logger, role, databaseUrl }), logger);
}

/**
 * Runs `step` of a start again while it fails for the database being unavailable (not up yet,
 * restarting, out of connections), as statements ride out an outage: a gateway started before its
 * database, or while it restarts, waits for it. Any other failure (a wrong password, a schema
 * this code does not expect) stops the start at once.
 */
function whenAvailable<T>(step: () => Promise<T>, logger: Logger): Promise<T> {
  return whileUnavailable(step, { log: { logger, message: 'database unavailable at start; waiting for it' } });
}

/**
 * `gateway start`: migrates and serves everything; with DATABASE_URL unset, on the embedded
 * Postgres under DATA_DIR, which it stops last.
 */
export async function start(baseConfig: Config): Promise<void> {
  const logger = createLogger(baseConfig);
  const database = await openDatabase(baseConfig, logger, { serves: true });
  try {
    const config = database.embedded ? await withLocalSecrets(baseConfig) : baseConfig;
    const pool = createPool(database.url, { max: 2, applicationName: 'gateway-migrate', logger, sessionSettings: false });
    await whenAvailable(() => migrate(pool, logger), logger).finally(() => pool.end());
    const gateway = await startRole({
      config,
      logger,
      role: 'all',
      databaseUrl: database.url,
      // The key generated under DATA_DIR, when none was set (a set one reaches them as it is).
      childEnv:
        baseConfig.secretEncryptionKeys.length === 0 && config.secretEncryptionKeys[0]
          ? { SECRET_ENCRYPTION_KEY: config.secretEncryptionKeys[0].toString('base64') }
          : {},
    });
    logger.info('ready; create a test key with: npm run gateway -- keys create --project demo --mode test');
    stopOnSignals(async () => {
      await gateway.stop();
      await database.release();
    }, logger);
    // Before this, a signal stopped the start and the embedded Postgres with it (embedded.ts).
    database.shutdownHandled();
  } catch (error) {
    await database.release();
    throw error;
  }
}

export { isClusterChild } from './cluster.ts';

/** One of the API processes a cluster's primary forked (API_PROCESSES > 1). */
export async function serveClusterChild(config: Config): Promise<void> {
  const logger = createLogger(config);
  // METRICS_PORT, when set, is the primary's: it serves everyone's metrics there.
  const gateway = await startGateway({ config, logger, role: 'api', databaseUrl: config.databaseUrl!, metricsPort: false }).catch(
    async (error: unknown) => {
      await tellPrimaryStartFailed(error);
      throw error;
    },
  );
  shareMetricsWithPrimary(gateway.metrics);
  // The primary decides when to stop (it relays SIGTERM); a Ctrl-C reaches it too.
  process.on('SIGINT', () => {});
  stopOnSignals(gateway.stop, logger, ['SIGTERM']);
}

/** A cluster's primary (cluster.ts), with the parts it runs: the worker role for --role all, and the METRICS_PORT server. */
async function startApiCluster(options: {
  config: Config;
  logger: Logger;
  role: Exclude<Role, 'worker'>;
  databaseUrl: string;
  childEnv: Record<string, string>;
}): Promise<{ stop(): Promise<void> }> {
  const { config, logger, role, databaseUrl } = options;
  // An API process stops at once on a schema it does not expect, or keys that cannot decrypt the
  // signing secrets, which would fail the cluster's start; the primary checks first, to say so
  // once rather than from every process.
  const checkPool = createPool(databaseUrl, { max: 1, applicationName: 'gateway-cluster', logger, sessionSettings: false });
  await whenAvailable(async () => {
    await assertSchemaCurrent(checkPool);
    await assertSecretsDecrypt(createDb(checkPool), config);
  }, logger).finally(() => checkPool.end());
  return startCluster({
    config,
    logger,
    databaseUrl,
    childEnv: options.childEnv,
    startWorker:
      role === 'all' ? () => startGateway({ config, logger, role: 'worker', databaseUrl, http: false }) : undefined,
    serveMetrics: async (metrics) => {
      const server = await listenForMetrics(config, metrics, logger);
      return { port: (server.address() as { port: number }).port, stop: () => closeServer(server) };
    },
  });
}

export interface AdminContext {
  pool: pg.Pool;
  logger: Logger;
  /** The config, with the embedded database's SECRET_ENCRYPTION_KEY when that is used. */
  config: Config;
}

/** An administrative command: what it prints. */
export type AdminCommand = (db: Db, context: AdminContext) => Promise<string>;

/**
 * Runs one administrative command against the database and prints what it returns on `io.out`.
 * Logs go to `io.err`, so that standard output (for --json) carries only the answer. With
 * DATABASE_URL unset, the embedded Postgres under DATA_DIR is used (started for the command if it
 * is not running).
 * Unless it is `migrate` (`anySchema`), a command refuses a database whose schema is not this
 * code's, saying what to run, rather than failing on a table or column it does not find.
 */
export async function runAdminCommand(
  config: Config,
  io: { out(text: string): void; err(text: string): void },
  command: AdminCommand,
  options: { anySchema?: boolean } = {},
): Promise<void> {
  const logger = createLogger(
    { logLevel: config.logLevel === 'info' ? 'warn' : config.logLevel },
    { write: (line: string) => io.err(line.replace(/\n$/, '')) },
  );
  const database = await openDatabase(config, logger, { serves: false });
  const effective = database.embedded ? await withLocalSecrets(config) : config;
  const pool = createPool(database.url, { max: 2, applicationName: 'gateway-cli', logger, sessionSettings: false });
  try {
    if (!options.anySchema) await assertSchemaCurrent(pool);
    io.out(await command(createDb(pool), { pool, logger, config: effective }));
  } finally {
    await pool.end();
    await database.release();
  }
}

/**
 * Stops an API process whose encryption keys do not decrypt the stored signing secrets: it
 * would answer every signed request with a 500. (Before any key exists there is nothing to try.)
 */
async function assertSecretsDecrypt(db: Db, config: Pick<Config, 'secretEncryptionKeys'>): Promise<void> {
  if (config.secretEncryptionKeys.length === 0) throw noEncryptionKey();
  const keyId = await signingSecretNotDecrypted(db, config.secretEncryptionKeys);
  if (keyId === undefined) return;
  const given = config.secretEncryptionKeys.length;
  throw new ConfigError(
    'SECRET_ENCRYPTION_KEY(S) cannot decrypt the stored signing secrets: ' +
      `the signing secret of key ${keyId} was stored with a key other than the ${given === 1 ? 'one' : `${given}`} given. ` +
      'Set the key they were stored with; to rotate keys, SECRET_ENCRYPTION_KEYS=<new key>,<old key>, then `gateway keys reencrypt`.',
  );
}

const noEncryptionKey = () =>
  new ConfigError('SECRET_ENCRYPTION_KEY is not set: the API needs it to decrypt signing secrets and verify request signatures.');

async function assertSchemaCurrent(pool: pg.Pool): Promise<void> {
  await assertMigrationsUnchanged(pool);
  const { applied, expected } = await schemaVersion(pool);
  if (applied !== expected) {
    throw new ConfigError(
      `The database schema is at migration ${applied}, this gateway needs ${expected}: run \`gateway migrate\` first.`,
    );
  }
}
