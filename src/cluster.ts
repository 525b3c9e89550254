// API_PROCESSES > 1: one Node process cannot use more than one core, so `gateway serve` (and
// `start`) fork that many API processes sharing PORT (node:cluster). The primary forks them,
// fails the start if one exits before it is listening (a port in use, a schema it does not
// expect: a replacement would fail the same way), once they all listen replaces any that dies,
// runs the worker role itself for --role all, relays a shutdown to every process, and answers
// /metrics for all of them with the sum of everyone's metrics: itself on METRICS_PORT when that
// is set, or else through the API processes on PORT (with METRICS_TOKEN: each asks the primary),
// so that a scrape sees the whole service whichever process it reaches.
import cluster, { type Worker as ClusterChild } from 'node:cluster';
import client from 'prom-client';
import { Backoff } from './client/backoff.ts';
import { ConfigError, type Config } from './config.ts';
import { errorSummary } from './db/pool.ts';
import type { Logger } from './logger.ts';
import { Metrics } from './metrics.ts';

const RESTART_MIN_MS = 250;
const RESTART_MAX_MS = 5_000;

type Message =
  | { type: 'gateway:collect'; id: number }
  | { type: 'gateway:collected'; id: number; text: string }
  | { type: 'gateway:metrics?'; id: number }
  | { type: 'gateway:metrics'; id: number; json: object[] }
  | { type: 'gateway:failed'; message: string };

export const isClusterChild = () => cluster.isWorker;

/** A part main.ts built for the primary, which the primary stops. */
interface Part {
  stop(): Promise<void>;
}

export interface ClusterOptions {
  config: Config;
  logger: Logger;
  databaseUrl: string;
  /** Settings the API processes need that this process may have made up (the embedded database). */
  childEnv: Record<string, string>;
  /**
   * Starts the worker role in the primary (for --role all); its health is the API processes',
   * its metrics are in every scrape (through an API process, or the primary's METRICS_PORT).
   */
  startWorker?: (() => Promise<Part & { metrics: Metrics }>) | undefined;
  /** Serves these metrics on METRICS_PORT (called only when it is set). */
  serveMetrics: (metrics: Metrics) => Promise<Part & { port: number }>;
}

/**
 * In the primary: forks the API processes and runs the worker role (for --role all). The API
 * processes' keys must decrypt the stored signing secrets (main.ts checks before it calls this).
 * Rejects, once the worker and the other API processes have stopped, if an API process exits
 * before it is listening, with what it failed on, or if METRICS_PORT cannot be listened on.
 */
export async function startCluster(options: ClusterOptions): Promise<{ stop(): Promise<void> }> {
  const { config, logger } = options;
  const log = logger.child({ component: 'cluster' });
  let stopping = false;
  const restartDelay = new Backoff(RESTART_MIN_MS, RESTART_MAX_MS);
  const env = { ...options.childEnv, DATABASE_URL: options.databaseUrl };
  let nextId = 0;
  const pending = new Map<number, { json: object[][]; left: number; done: (json: object[][]) => void }>();
  /** What each API process that failed to start said it failed on, by its cluster id. */
  const failures = new Map<number, string>();

  const fork = () => {
    const child = cluster.fork(env);
    child.on('message', (message: Message) => {
      if (message.type === 'gateway:failed') {
        failures.set(child.id, message.message);
      } else if (message.type === 'gateway:collect') {
        collect().then(
          (text) => child.isConnected() && child.send({ type: 'gateway:collected', id: message.id, text }),
          (error: unknown) => log.warn({ err: errorSummary(error) }, 'collecting metrics failed'),
        );
      }
    });
    return child;
  };

  // Until every API process has listened once, one that exits fails the start: what stopped it
  // (a port in use, a schema it does not expect) would stop its replacement too. After that, one
  // that exits is replaced.
  let startedUp = false;
  /** Replacements due: a shutdown cancels them (stopAll), or they would start while it drains, and be cut off at its end. */
  const restarts = new Set<NodeJS.Timeout>();
  let failStart: (error: Error) => void = () => {};
  cluster.on('exit', (child, code, signal) => {
    const failure = failures.get(child.id);
    failures.delete(child.id);
    if (stopping) return;
    if (!startedUp) {
      failStart(
        new ConfigError(
          failure === undefined
            ? `An API process exited before it was listening (${signal ? `signal ${signal}` : `exit code ${code}`}).`
            : `An API process could not start: ${failure}`,
        ),
      );
      return;
    }
    log.error({ pid: child.process.pid, code, signal, ...(failure && { err: failure }) }, 'an API process exited; starting another');
    const timer = setTimeout(() => {
      restarts.delete(timer);
      fork();
    }, restartDelay.next());
    restarts.add(timer);
  });
  cluster.on('listening', () => {
    restartDelay.reset();
  });

  // The worker role, in this process; its health is the API processes', its metrics in every scrape.
  const worker = await options.startWorker?.();
  // The primary's own registry (the worker's, for --role all): its process, and its scrapes.
  const metrics = worker?.metrics ?? new Metrics();

  let metricsServer: (Part & { port: number }) | undefined;
  const listening = new Promise<void>((resolve, reject) => {
    failStart = reject;
    let count = 0;
    cluster.on('listening', () => {
      if (++count === config.apiProcesses) resolve();
    });
  });
  for (let i = 0; i < config.apiProcesses; i++) fork();
  try {
    await listening;
  } catch (error) {
    await stopAll();
    throw error;
  }
  startedUp = true;
  log.info({ apiProcesses: config.apiProcesses, port: config.port }, 'API processes listening');

  if (config.metricsPort !== undefined) {
    metrics.renderWith(collect);
    try {
      metricsServer = await options.serveMetrics(metrics);
    } catch (error) {
      // METRICS_PORT in use, say: the API processes listening and the worker are stopped in order.
      await stopAll();
      throw error;
    }
    log.info({ metricsPort: metricsServer.port }, 'serving the metrics of every process');
  }

  cluster.on('message', (_child, message: Message) => {
    if (message.type !== 'gateway:metrics') return;
    const entry = pending.get(message.id);
    if (!entry) return;
    entry.json.push(message.json);
    if (--entry.left === 0) entry.done(entry.json);
  });

  /** Everyone's metrics, summed (gauges by their own aggregator). */
  async function collect(): Promise<string> {
    const children = Object.values(cluster.workers ?? {}).filter((child): child is ClusterChild => !!child?.isConnected());
    const id = nextId++;
    const fromChildren = new Promise<object[][]>((resolve) => {
      const entry = { json: [] as object[][], left: children.length, done: resolve };
      pending.set(id, entry);
      // A process that does not answer in time is left out of this scrape.
      setTimeout(() => resolve(entry.json), 2_000).unref();
    });
    for (const child of children) child.send({ type: 'gateway:metrics?', id });
    const json = await fromChildren;
    pending.delete(id);
    json.push(await metrics.registry.getMetricsAsJSON());
    return client.AggregatorRegistry.aggregate(json).metrics();
  }

  /** Stops every API process, the METRICS_PORT server and the worker. */
  async function stopAll(): Promise<void> {
    stopping = true;
    for (const timer of restarts) clearTimeout(timer);
    const children = Object.values(cluster.workers ?? {}).filter((child): child is ClusterChild => !!child && !child.isDead());
    const exited = children.map((child) => new Promise<void>((resolve) => child.once('exit', () => resolve())));
    const metricsClosed = metricsServer?.stop();
    // Each API process drains itself: no new connections, waiters answered, then it exits.
    for (const child of children) child.process.kill('SIGTERM');
    await Promise.all(exited);
    await metricsClosed;
    await worker?.stop();
  }

  return { stop: stopAll };
}

/**
 * In an API process of the cluster: tells the primary what its start failed on, before the
 * process exits, so that the primary's start fails with it.
 */
export function tellPrimaryStartFailed(error: unknown): Promise<void> {
  const message: Message = { type: 'gateway:failed', message: errorSummary(error).message };
  return new Promise<void>((resolve) => {
    if (!process.send || !process.connected) return resolve();
    process.send(message, undefined, {}, () => resolve());
  });
}

/**
 * In an API process of the cluster: answers the primary's requests for its metrics, and its own
 * /metrics (when PORT serves one) is everyone's, collected by the primary.
 */
export function shareMetricsWithPrimary(metrics: Metrics): void {
  let nextId = 0;
  const waiting = new Map<number, (text: string) => void>();
  process.on('message', (message: Message) => {
    if (message.type === 'gateway:metrics?') {
      metrics.registry.getMetricsAsJSON().then((json) => process.send?.({ type: 'gateway:metrics', id: message.id, json }));
    } else if (message.type === 'gateway:collected') {
      waiting.get(message.id)?.(message.text);
      waiting.delete(message.id);
    }
  });
  metrics.renderWith(
    () =>
      new Promise<string>((resolve, reject) => {
        const id = nextId++;
        waiting.set(id, resolve);
        process.send?.({ type: 'gateway:collect', id });
        setTimeout(() => {
          if (waiting.delete(id)) reject(new Error('the primary process did not answer with the metrics'));
        }, 5_000).unref();
      }),
  );
}
