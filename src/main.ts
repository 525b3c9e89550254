// The composition root: builds the API and/or the worker from a config, and shuts them down
// in order: stop accepting connections, answer every waiting request with its acknowledgement,
// let running attempts finish, then close the pools.
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import type { Duplex } from 'node:stream';
import type pg from 'pg';
import { ConfigError, type Config } from './config.ts';
import { schemaVersion } from './db/migrate.ts';
import { createDb, createPool, type Db } from './db/pool.ts';
import { ApiError, invalidRequest } from './errors.ts';
import { createApp, createMetricsApp, createOpsApp } from './http/app.ts';
import type { Logger } from './logger.ts';
import { Metrics } from './metrics.ts';
import { Listener } from './db/listener.ts';
import { KeyCache } from './keys/cache.ts';
import { signingSecretNotDecrypted } from './keys/service.ts';
import { FINISHED_CHANNEL, Waiters } from './requests/waiters.ts';
import { LaneRouter } from './lanes/routing.ts';
import { intakeLimitsFor, type IntakeLimits } from './requests/intake.ts';
import { createAttempts, type Attempts } from './worker/attempts.ts';
import { Dispatcher } from './worker/dispatcher.ts';
import { startWorkerService, type WorkerService } from './worker/supervisor.ts';
import { WebhookDeliverer } from './webhooks/deliverer.ts';

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
  stop(): Promise<void>;
}

export async function startGateway(options: GatewayOptions): Promise<Gateway> {
  const { config, logger, role, databaseUrl } = options;
  if (role !== 'worker' && config.secretEncryptionKeys.length === 0) throw noEncryptionKey();
  let apiPool: pg.Pool | undefined;
  let workerPool: pg.Pool | undefined;
  let listener: Listener | undefined;
  let waiters: Waiters | undefined;
  let keys: KeyCache | undefined;
  let server: http.Server | undefined;
  let metricsServer: http.Server | undefined;
  let worker: WorkerService | undefined;
  let intake: IntakeLimits | undefined;
  let attempts: Attempts | undefined;
  const metrics = new Metrics();

  const stop = async () => {
    // Calls in flight get SHUTDOWN_GRACE_MS while the server closes.
    const attemptsStopped = worker?.stop();
    const metricsClosed = metricsServer && closeServer(metricsServer);
    if (server) {
      const closed = closeServer(server);
      // Waiting wait=true requests are answered now with their acknowledgement, rather than
      // holding the shutdown for up to WAIT_TIMEOUT_MS.
      waiters?.close();
      await closed;
    }
    waiters?.close();
    await metricsClosed;
    await attemptsStopped;
    await attempts?.close();
    await intake?.stop();
    await listener?.close();
    await workerPool?.end();
    await apiPool?.end();
  };

  try {
    // One LISTEN connection per process, for whichever of its parts need to hear: waiters and
    // the key cache, and the dispatcher (a call whose request was cancelled is aborted).
    listener = new Listener(databaseUrl, logger);
    // The worker's side first (it opens no connection yet): the API of the same process
    // dispatches the requests it accepts on it.
    let workerDb: Db | undefined;
    let dispatcher: Dispatcher | undefined;
    let deliverer: WebhookDeliverer | undefined;
    if (role !== 'api') {
      workerPool = createPool(databaseUrl, { max: config.workerPoolSize, applicationName: 'gateway-worker', logger });
      workerDb = createDb(workerPool);
      metrics.watchPool('worker', workerPool);
      attempts = createAttempts({
        db: workerDb,
        config,
        metrics,
        logger,
        // In the same process, waiters hear of a completion at once, before the NOTIFY arrives.
        onFinished: (id) => waiters?.wake([id]),
      });
      dispatcher = new Dispatcher({
        db: workerDb,
        attempts,
        upstreams: config.upstreams,
        capacity: { live: config.maxInFlight, test: config.testMaxInFlight },
        upstreamTimeoutMs: config.upstreamTimeoutMs,
        graceMs: config.shutdownGraceMs,
        logger,
      });
      metrics.watchDispatcher(dispatcher);
      deliverer = new WebhookDeliverer({ db: workerDb, config, workerId: dispatcher.workerId, metrics, logger });
      const hearing = dispatcher;
      listener.subscribe(FINISHED_CHANNEL, {
        notification: (payload) => hearing.ended(payload.split(',')),
        lost: () => hearing.hearing(false),
        restored: () => hearing.hearing(true),
      });
    }
    if (role !== 'worker') {
      apiPool = createPool(databaseUrl, { max: config.databasePoolSize, applicationName: 'gateway-api', logger });
      await assertSchemaCurrent(apiPool);
      const db = createDb(apiPool);
      await assertSecretsDecrypt(db, config);
      waiters = new Waiters(listener);
      keys = new KeyCache(listener);
      await listener.start();
      metrics.watchPool('api', apiPool);
      metrics.watchWaiters(waiters);
      metrics.watchQueue(db);
      metrics.watchWebhooks(db);
      const lanes = new LaneRouter(db, config);
      intake = intakeLimitsFor(db, config, {
        logger,
        onRefused: (mode, limit) => metrics.intakeRefused.inc({ mode, limit }),
      });
      intake?.start();
      // A worker in this process dispatches the requests this API accepts, without a queue hop.
      const dispatching = dispatcher;
      const app = createApp({
        config,
        pool: apiPool,
        db,
        waiters,
        keys,
        metrics,
        logger,
        lanes,
        intake,
        ...(dispatching ? { onStored: (laneId: string) => dispatching.poke(laneId) } : {}),
      });
      server = await listen(app.callback(), config.port, config.host);
    }
    if (workerPool && workerDb && attempts && dispatcher && deliverer) {
      if (role === 'worker') {
        await assertSchemaCurrent(workerPool);
        await listener.start();
        metrics.watchQueue(workerDb);
        metrics.watchWebhooks(workerDb);
        if (options.http !== false) {
          server = await listen(createOpsApp({ config, pool: workerPool, metrics, logger }).callback(), config.port, config.host);
        }
      }
      worker = await startWorkerService({
        config,
        pool: workerPool,
        db: workerDb,
        metrics,
        logger,
        attempts,
        dispatcher,
        deliverer,
      });
    }
    if (options.http !== false && options.metricsPort !== false && config.metricsPort !== undefined) {
      metricsServer = await listen(createMetricsApp({ config, metrics, logger }).callback(), config.metricsPort, config.host);
    }
  } catch (error) {
    await stop().catch(() => {});
    throw error;
  }

  const url = urlOf(server);
  const metricsUrl = urlOf(metricsServer);
  logger.info({ role, url, ...(metricsUrl ? { metricsUrl } : {}) }, 'gateway started');
  return { url, metricsUrl, metrics, waiters, keys, stop };
}

/**
 * Stops an API process whose encryption keys do not decrypt the stored signing secrets: it
 * would answer every signed request with a 500. (Before any key exists there is nothing to try.)
 */
export async function assertSecretsDecrypt(db: Db, config: Pick<Config, 'secretEncryptionKeys'>): Promise<void> {
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
  const { applied, expected } = await schemaVersion(pool);
  if (applied !== expected) {
    throw new Error(
      `The database schema is at migration ${applied}, this gateway needs ${expected}: run \`gateway migrate\` first.`,
    );
  }
}

export function listen(handler: http.RequestListener, port: number, host: string): Promise<http.Server> {
  const server = http.createServer(
    {
      // Hostile or broken clients may not hold a socket open without sending a request.
      headersTimeout: 10_000,
      requestTimeout: 30_000,
      keepAliveTimeout: 5_000,
      maxHeaderSize: 16 * 1024,
    },
    handler,
  );
  server.maxHeadersCount = 100;
  server.on('clientError', answerClientError);
  return new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, host, () => {
      server.off('error', reject);
      resolve(server);
    });
  });
}

/**
 * Requests too broken to reach the app (unparseable HTTP, oversized headers) still get the
 * contract's error shape; a client too slow to send its request just loses the connection.
 */
function answerClientError(error: Error & { code?: string }, socket: Duplex): void {
  if (!socket.writable || error.code === 'ECONNRESET') {
    socket.destroy();
    return;
  }
  if (error.code === 'ERR_HTTP_REQUEST_TIMEOUT') {
    socket.end();
    return;
  }
  const apiError =
    error.code === 'HPE_HEADER_OVERFLOW'
      ? new ApiError(413, 'invalid_request_error', 'request_too_large', 'The request headers are too large.')
      : invalidRequest('invalid_body', 'The request is not valid HTTP/1.1.');
  const body = JSON.stringify(apiError.toBody());
  socket.end(
    `HTTP/1.1 ${apiError.status} ${http.STATUS_CODES[apiError.status]}\r\n` +
      `content-type: application/json; charset=utf-8\r\ncontent-length: ${Buffer.byteLength(body)}\r\n` +
      `connection: close\r\n\r\n${body}`,
  );
}

/** Stops accepting, closes idle keep-alive sockets, and resolves when in-flight requests are answered. */
export function closeServer(server: http.Server): Promise<void> {
  return new Promise((resolve) => {
    server.close(() => resolve());
    server.closeIdleConnections();
  });
}

function urlOf(server: http.Server | undefined): string {
  const address = server?.address() as AddressInfo | null | undefined;
  return address ? `http://${hostForUrl(address)}:${address.port}` : '';
}

function hostForUrl(address: AddressInfo): string {
  if (address.address === '0.0.0.0' || address.address === '::') return '127.0.0.1';
  return address.family === 'IPv6' ? `[${address.address}]` : address.address;
}
