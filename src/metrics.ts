// Prometheus metrics (prom-client), one registry per gateway. Labels are routes, methods,
// statuses, modes, outcomes and error codes: never a key, id, project or message.
import client from 'prom-client';
import type pg from 'pg';
import { sharedRead } from './shared-read.ts';

const PREFIX = 'gateway_';

/** How long a gauge read from the database (the queue, webhooks) answers every scrape. */
const DATABASE_GAUGE_TTL_MS = 5_000;

/**
 * A gauge's read from the database, shared as sharedRead shares it, its failure too (undefined,
 * kept as long as a figure): while the database is out of reach, the gauge keeps its last figure
 * and a scrape answers with every other metric, which an outage is when they are wanted most;
 * nor does a flood of scrapes try the database more than once per ttlMs.
 */
function gaugeRead<T>(read: () => Promise<T>, ttlMs: number): () => Promise<T | undefined> {
  return sharedRead(async () => {
    try {
      return await read();
    } catch {
      return undefined;
    }
  }, ttlMs);
}

export class Metrics {
  readonly registry = new client.Registry();
  readonly #databaseGaugeTtlMs: number;

  readonly httpRequests = new client.Counter({
    name: `${PREFIX}http_requests_total`,
    help: 'HTTP requests answered, by method, route pattern and status; those the server answers itself before any route (not HTTP, headers too large, no Host, CONNECT) with route "unmatched" (method "unknown" when it could not be parsed).',
    labelNames: ['method', 'route', 'status'] as const,
    registers: [this.registry],
  });

  readonly httpDuration = new client.Histogram({
    name: `${PREFIX}http_request_duration_seconds`,
    help: 'Time to answer an HTTP request (a wait=true request includes its wait); not for the answers the server gives itself.',
    labelNames: ['method', 'route'] as const,
    buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
    registers: [this.registry],
  });

  readonly accepted = new client.Counter({
    name: `${PREFIX}requests_accepted_total`,
    help: 'Chat completion requests accepted and stored (idempotent replays excluded), by key mode.',
    labelNames: ['mode'] as const,
    registers: [this.registry],
  });

  readonly insertGroupSize = new client.Histogram({
    name: `${PREFIX}insert_group_size`,
    help: 'Requests written per insert statement (group commit), idempotent replays included.',
    buckets: [1, 2, 5, 10, 25, 50, 100, 250, 500],
    registers: [this.registry],
  });

  readonly durableWrites = new client.Histogram({
    name: `${PREFIX}db_write_duration_seconds`,
    help: 'Time of the grouped writes that must be durable before anyone is told, by write: accept (requests stored, before they are acknowledged) and finish (attempts recorded, before their results are handed over). From asking the pool for a connection (a wait for one included) to the commit flushed: the database\'s part of a wait=true request, where a slow disk shows first.',
    labelNames: ['write'] as const,
    buckets: [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
    registers: [this.registry],
  });

  readonly attempts = new client.Counter({
    name: `${PREFIX}attempts_total`,
    help: 'Attempts finished, each counted once it is recorded, by the worker that records it, by mode, outcome (succeeded, failed, cancelled: the request ended meanwhile) and error code ("none" unless failed).',
    labelNames: ['mode', 'outcome', 'code'] as const,
    registers: [this.registry],
  });

  readonly upstreamDuration = new client.Histogram({
    name: `${PREFIX}upstream_duration_seconds`,
    help: 'Time of the upstream call (the simulator in test mode), by mode and outcome.',
    labelNames: ['mode', 'outcome'] as const,
    buckets: [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120],
    registers: [this.registry],
  });

  readonly tokens = new client.Counter({
    name: `${PREFIX}tokens_total`,
    help: 'Tokens of completed requests (their usage), by mode, upstream, model (as configured: a name or a pattern) and kind (prompt, completion).',
    labelNames: ['mode', 'upstream', 'model', 'kind'] as const,
    registers: [this.registry],
  });

  readonly laneHealthChanges = new client.Counter({
    name: `${PREFIX}lane_health_changes_total`,
    help: 'Lanes that changed health, as recorded by this process, by upstream and the health reached (open, probing, healthy): an open lane\'s provider is failing.',
    labelNames: ['upstream', 'health'] as const,
    registers: [this.registry],
  });

  readonly cancelled = new client.Counter({
    name: `${PREFIX}requests_cancelled_total`,
    help: 'Requests cancelled by their clients, by mode and the status they had (queued, retrying, processing).',
    labelNames: ['mode', 'from'] as const,
    registers: [this.registry],
  });

  readonly expired = new client.Counter({
    name: `${PREFIX}requests_expired_total`,
    help: 'Requests failed with deadline_exceeded, their deadline passed, by mode and the status they had (queued, retrying, processing).',
    labelNames: ['mode', 'from'] as const,
    registers: [this.registry],
  });

  readonly rescuedQueues = new client.Counter({
    name: `${PREFIX}queues_rescued_total`,
    help: 'Queues found with requests due and nothing to dispatch them (no job, no recent claim, no call whose end would), and dispatched, by mode.',
    labelNames: ['mode'] as const,
    registers: [this.registry],
  });

  readonly rescuedEndpoints = new client.Counter({
    name: `${PREFIX}webhook_endpoints_rescued_total`,
    help: 'Webhook endpoints found with messages due and nothing to deliver them (no wake job, no delivery job due), and woken.',
    registers: [this.registry],
  });

  readonly spentJobsDeleted = new client.Counter({
    name: `${PREFIX}spent_jobs_deleted_total`,
    help: 'graphile-worker jobs that used up their attempts (each run threw), deleted by a worker, by task.',
    labelNames: ['task'] as const,
    registers: [this.registry],
  });

  readonly intakeRefused = new client.Counter({
    name: `${PREFIX}intake_refused_total`,
    help: 'Requests refused with 429 by the intake limits, by mode and limit (rate, bytes_rate, lookup_rate, unfinished).',
    labelNames: ['mode', 'limit'] as const,
    registers: [this.registry],
  });

  readonly webhookDeliveries = new client.Counter({
    name: `${PREFIX}webhook_deliveries_total`,
    help: 'Webhook delivery tries finished, each counted once its end is recorded, by the worker that records it, by outcome: succeeded (a 2xx), failed (retried, or given up once the schedule is spent; handed back, its worker lost), disabled (a 410).',
    labelNames: ['outcome'] as const,
    registers: [this.registry],
  });

  readonly webhookDeferrals = new client.Counter({
    name: `${PREFIX}webhook_deferrals_total`,
    help: 'Webhook tries not started when due, by reason: endpoint_busy (WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT), worker_busy (WEBHOOK_MAX_IN_FLIGHT), endpoint_backing_off (it timed out, or its retry-after pauses it). They wait for their endpoint\'s wake; none costs a retry.',
    labelNames: ['reason'] as const,
    registers: [this.registry],
  });

  readonly unknownKeys = new client.Counter({
    name: `${PREFIX}unknown_keys_total`,
    help: 'Requests refused because their API key, well formed, is not known or is revoked, or fails its checksum (a guess, a typo, a flood).',
    registers: [this.registry],
  });

  readonly keyReadsRefused = new client.Counter({
    name: `${PREFIX}key_reads_refused_total`,
    help: 'Requests refused with 503 because this API process already had as many reads of keys not in its cache under way and waiting as it allows (keys/reads.ts): a flood of unknown keys.',
    registers: [this.registry],
  });

  readonly #pools = new Map<string, pg.Pool>();

  /** `databaseGaugeTtlMs`: how long a gauge read from the database is reused (tests shorten it). */
  constructor(options: { databaseGaugeTtlMs?: number } = {}) {
    this.#databaseGaugeTtlMs = options.databaseGaugeTtlMs ?? DATABASE_GAUGE_TTL_MS;
    client.collectDefaultMetrics({ register: this.registry, prefix: PREFIX });
    const pools = this.#pools;
    new client.Gauge({
      name: `${PREFIX}db_pool_connections`,
      help: 'Database pool connections by state: in_use, idle, and waiting (callers queued for one).',
      labelNames: ['pool', 'state'] as const,
      registers: [this.registry],
      collect() {
        for (const [name, pool] of pools) {
          this.set({ pool: name, state: 'in_use' }, pool.totalCount - pool.idleCount);
          this.set({ pool: name, state: 'idle' }, pool.idleCount);
          this.set({ pool: name, state: 'waiting' }, pool.waitingCount);
        }
      },
    });
  }

  /** gateway_waiters: wait=true requests held open in this process. */
  watchWaiters(waiters: { readonly size: number }): void {
    this.#sizeGauge('waiters', 'wait=true requests currently held open by this process.', () => waiters.size);
  }

  /** gateway_upstream_calls_in_flight{mode}: calls this worker process has under way (MAX_IN_FLIGHT, TEST_MAX_IN_FLIGHT). */
  watchDispatcher(dispatcher: { inFlight(mode: 'live' | 'test'): number }): void {
    new client.Gauge({
      name: `${PREFIX}upstream_calls_in_flight`,
      help: 'Upstream calls (simulated in test mode) this worker process has under way, by mode.',
      labelNames: ['mode'] as const,
      registers: [this.registry],
      collect() {
        for (const mode of ['live', 'test'] as const) this.set({ mode }, dispatcher.inFlight(mode));
      },
    });
  }

  /**
   * gateway_upstream_answer_memory_bytes: reserved by the large upstream answers this worker
   * process is reading (UPSTREAM_ANSWER_MEMORY_MB); gateway_upstream_answers_waiting_for_memory:
   * answers paused until their share is free.
   */
  watchAnswerMemory(memory: { readonly reserved: number; readonly waiting: number }): void {
    this.#sizeGauge(
      'upstream_answer_memory_bytes',
      'Memory reserved by the upstream answers over 16 KB this worker process is reading (UPSTREAM_ANSWER_MEMORY_MB).',
      () => memory.reserved,
    );
    this.#sizeGauge(
      'upstream_answers_waiting_for_memory',
      'Upstream answers over 16 KB paused, their connection idle, until UPSTREAM_ANSWER_MEMORY_MB has room for them.',
      () => memory.waiting,
    );
  }

  /** A gauge set from `read()` at each scrape. */
  #sizeGauge(name: string, help: string, read: () => number): void {
    new client.Gauge({
      name: `${PREFIX}${name}`,
      help,
      registers: [this.registry],
      collect() {
        this.set(read());
      },
    });
  }

  /** gateway_db_pool_connections{pool,state}: in use, idle, and callers waiting for a connection. */
  watchPool(name: string, pool: pg.Pool): void {
    this.#pools.set(name, pool);
  }

  /**
   * gateway_requests{status,mode}: requests not finished yet, read from the database by
   * `readQueue` (requests/inspection.ts countUnfinishedByStatus; once per few seconds, whoever
   * scrapes: see sharedRead) and the same figure in every process: aggregate it with max, not sum.
   */
  watchQueue(readQueue: () => Promise<readonly { status: string; mode: string; count: number }[]>): void {
    const read = gaugeRead(readQueue, this.#databaseGaugeTtlMs);
    new client.Gauge({
      name: `${PREFIX}requests`,
      help: 'Requests not finished yet (the queue), by status and mode, as the database has them.',
      labelNames: ['status', 'mode'] as const,
      // Every process reads the same rows: across processes the figure is the same, not a sum.
      aggregator: 'max',
      registers: [this.registry],
      async collect() {
        const rows = await read();
        if (rows === undefined) return;
        this.reset();
        for (const status of ['queued', 'processing', 'retrying']) {
          for (const mode of ['live', 'test']) {
            const row = rows.find((r) => r.status === status && r.mode === mode);
            this.set({ status, mode }, row?.count ?? 0);
          }
        }
      },
    });
  }

  /**
   * gateway_webhook_oldest_pending_seconds: the age of the oldest webhook message not delivered
   * nor given up, in seconds, read from the database by `readOldestAge` (webhooks/repository.ts
   * oldestUnfinishedMessageAge; once per few seconds, as watchQueue's) and the same in every
   * process: aggregate it with max.
   */
  watchWebhooks(readOldestAge: () => Promise<number>): void {
    const read = gaugeRead(readOldestAge, this.#databaseGaugeTtlMs);
    new client.Gauge({
      name: `${PREFIX}webhook_oldest_pending_seconds`,
      help: 'Age of the oldest webhook message not yet delivered (nor given up), as the database has it; 0 when there is none.',
      aggregator: 'max',
      registers: [this.registry],
      async collect() {
        const age = await read();
        if (age !== undefined) this.set(Math.max(0, age));
      },
    });
  }

  #render: () => Promise<string> = () => this.registry.metrics();

  /** The text of GET /metrics: this registry's, unless renderWith() says otherwise. */
  render(): Promise<string> {
    return this.#render();
  }

  /**
   * For the processes of a cluster (see cluster.ts): an API process's scrape, or the primary's on
   * METRICS_PORT, answers for every process.
   */
  renderWith(render: () => Promise<string>): void {
    this.#render = render;
  }

  get contentType(): string {
    return this.registry.contentType;
  }
}
