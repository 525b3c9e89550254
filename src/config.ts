// The only reader of process.env. Every setting is parsed and checked here, once, and the
// result is frozen and passed down as a value. A bad setting stops the process at start-up
// with a message naming every variable at fault.
import pg from 'pg';
import * as v from 'valibot';
// MAX_WAIT_MS, the longest a timer waits (Node runs a longer setTimeout after 1 ms): a setting
// that becomes a timer is refused beyond it, as the client library refuses such an option.
import { MAX_WAIT_MS } from './client/request.ts';
import { Deadline, Duration } from './duration.ts';
import { defaultUpstream, hasCredentials, loadUpstreamsFile, UpstreamsFileError, type Upstream } from './upstream/upstreams.ts';

/**
 * What one upstream call in flight costs a worker process in resident memory: its connection,
 * buffers, request and timer, and the garbage they make between collections: a round figure
 * above what make bench's slow-upstream phase measures (BENCHMARKS.md). The default in-flight
 * capacity is the memory budget divided by this.
 */
const MEMORY_PER_CALL_KB = 20;
/** The longest a test-delay-<ms> model may ask for, whatever UPSTREAM_TIMEOUT_MS says. */
const TEST_DELAY_CEILING_MS = 600_000;


/** One of `options`, trimmed. */
const oneOf = <const T extends readonly [string, ...string[]]>(options: T, fallback: T[number], message?: string) =>
  v.optional(v.pipe(v.string(), v.trim(), v.picklist(options, message)), fallback);

const integer = (name: string, fallback: number, min: number, max = Number.MAX_SAFE_INTEGER) =>
  v.optional(
    v.pipe(
      v.string(),
      v.trim(),
      v.regex(/^\d+$/, `${name} must be a whole number`),
      v.transform(Number),
      v.minValue(min, `${name} must be at least ${min}`),
      v.maxValue(max, `${name} must be at most ${max}`),
    ),
    String(fallback),
  );

/** A whole number that may be left unset (or empty). */
const optionalInteger = (name: string, min: number, max = Number.MAX_SAFE_INTEGER) =>
  v.optional(
    v.pipe(
      v.string(),
      v.trim(),
      v.check((value) => value === '' || /^\d+$/.test(value), `${name} must be a whole number`),
      v.transform((value) => (value === '' ? undefined : Number(value))),
      v.check((value) => value === undefined || value >= min, `${name} must be at least ${min}`),
      v.check((value) => value === undefined || value <= max, `${name} must be at most ${max}`),
    ),
  );

const text = (fallback: string) => v.optional(v.pipe(v.string(), v.trim(), v.minLength(1)), fallback);

const optionalText = v.optional(
  v.pipe(
    v.string(),
    v.trim(),
    v.transform((value) => (value === '' ? undefined : value)),
  ),
);

/**
 * A Postgres connection string, as pg reads it: a postgres:// or postgresql:// URL. What is wrong
 * is said without the value, which may hold a password.
 */
const databaseUrl = v.optional(
  v.pipe(
    optionalText,
    v.check(
      (value) => value === undefined || (/^postgres(ql)?:\/\//i.test(value) && URL.canParse(value)),
      'DATABASE_URL must be a postgres:// or postgresql:// URL, such as postgres://user:password@host:5432/database ' +
        '(a password\'s reserved characters written as %XX)',
    ),
  ),
);

const Environment = v.object({
  DATABASE_URL: databaseUrl,
  PORT: integer('PORT', 8080, 0, 65535),
  API_PROCESSES: integer('API_PROCESSES', 1, 1, 64),
  HOST: text('0.0.0.0'),
  LOG_LEVEL: oneOf(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'], 'info'),

  WAIT_TIMEOUT_MS: integer('WAIT_TIMEOUT_MS', 30_000, 0, 600_000),
  MAX_BODY_BYTES: integer('MAX_BODY_BYTES', 4 * 1024 * 1024, 1024),
  SIGNATURES: oneOf(['required', 'optional'], 'required'),
  SECRET_ENCRYPTION_KEY: optionalText,
  SECRET_ENCRYPTION_KEYS: optionalText,
  METRICS_PORT: optionalInteger('METRICS_PORT', 0, 65535),
  METRICS_TOKEN: optionalText,

  UPSTREAM_BASE_URL: v.optional(
    v.pipe(
      v.string(),
      v.trim(),
      v.url('UPSTREAM_BASE_URL must be a URL'),
      v.check((url) => !hasCredentials(url), 'UPSTREAM_BASE_URL may not hold a user name or password: set UPSTREAM_API_KEY'),
      v.transform((url) => url.replace(/\/+$/, '')),
    ),
    'https://api.openai.com/v1',
  ),
  UPSTREAM_API_KEY: optionalText,
  UPSTREAM_TIMEOUT_MS: integer('UPSTREAM_TIMEOUT_MS', 120_000, 1, MAX_WAIT_MS),
  UPSTREAM_MAX_RESPONSE_BYTES: integer('UPSTREAM_MAX_RESPONSE_BYTES', 2 * 1024 * 1024, 1024),
  UPSTREAMS_FILE: optionalText,
  UPSTREAM_MEMORY_MB: integer('UPSTREAM_MEMORY_MB', 256, 1, 1_000_000),
  UPSTREAM_ANSWER_MEMORY_MB: integer('UPSTREAM_ANSWER_MEMORY_MB', 256, 1, 1_000_000),
  MAX_IN_FLIGHT: optionalInteger('MAX_IN_FLIGHT', 1),
  TEST_MAX_IN_FLIGHT: integer('TEST_MAX_IN_FLIGHT', 1_000, 1, 1_000_000),
  MAX_PATTERN_MODELS: integer('MAX_PATTERN_MODELS', 1_000, 0, 1_000_000),
  PRUNE_IDLE_QUEUES_AFTER: v.optional(Duration('PRUNE_IDLE_QUEUES_AFTER', 1_000, 30 * 86_400_000), '1h'),

  WEBHOOK_ALLOW_PRIVATE: oneOf(['true', 'false'], 'false', 'WEBHOOK_ALLOW_PRIVATE must be true or false'),
  WEBHOOK_TIMEOUT_MS: integer('WEBHOOK_TIMEOUT_MS', 15_000, 1, MAX_WAIT_MS),
  WEBHOOK_RETRY_SCHEDULE: v.optional(
    v.pipe(
      v.string(),
      v.trim(),
      v.regex(/^\d+(,\d+)*$/, 'WEBHOOK_RETRY_SCHEDULE must be whole numbers of milliseconds, separated by commas'),
      v.transform((list) => Object.freeze(list.split(',').map(Number))),
    ),
    // After the first try: 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h (Standard Webhooks' schedule).
    '5000,300000,1800000,7200000,18000000,36000000,36000000',
  ),
  WEBHOOK_MAX_IN_FLIGHT: integer('WEBHOOK_MAX_IN_FLIGHT', 1_000, 1, 100_000),
  WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT: integer('WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT', 10, 1, 100_000),

  RATE_LIMIT_RPS: optionalInteger('RATE_LIMIT_RPS', 1),
  LOOKUP_RATE_LIMIT_RPS: optionalInteger('LOOKUP_RATE_LIMIT_RPS', 1),
  RATE_LIMIT_BYTES_PER_SECOND: optionalInteger('RATE_LIMIT_BYTES_PER_SECOND', 1024),
  MAX_UNFINISHED_PER_PROJECT: optionalInteger('MAX_UNFINISHED_PER_PROJECT', 1),

  REQUEST_DEADLINE: v.optional(Deadline('REQUEST_DEADLINE'), '24h'),
  MAX_ATTEMPTS: integer('MAX_ATTEMPTS', 5, 1, 100),
  RETRY_BASE_MS: integer('RETRY_BASE_MS', 1_000, 0, MAX_WAIT_MS),
  RETRY_MAX_MS: integer('RETRY_MAX_MS', 60_000, 0, MAX_WAIT_MS),

  WORKER_CONCURRENCY: integer('WORKER_CONCURRENCY', 100, 1, 10_000),
  WORKER_POLL_INTERVAL_MS: integer('WORKER_POLL_INTERVAL_MS', 1_000, 10, MAX_WAIT_MS),
  RETENTION_DAYS: integer('RETENTION_DAYS', 30, 1, 36_500),
  BODY_RETENTION_HOURS: optionalInteger('BODY_RETENTION_HOURS', 1),
  WORKER_DEAD_AFTER_MS: integer('WORKER_DEAD_AFTER_MS', 7_000, 500, MAX_WAIT_MS),
  SHUTDOWN_GRACE_MS: integer('SHUTDOWN_GRACE_MS', 6_000, 0, MAX_WAIT_MS),
  DATABASE_POOL_SIZE: integer('DATABASE_POOL_SIZE', 10, 2, 1_000),
  WORKER_POOL_SIZE: integer('WORKER_POOL_SIZE', 10, 3, 1_000),

  GATEWAY_API_KEY: optionalText,
  GATEWAY_SIGNING_SECRET: optionalText,
  GATEWAY_BASE_URL: v.optional(v.pipe(v.string(), v.trim(), v.url('GATEWAY_BASE_URL must be a URL')), 'http://localhost:8080'),

  DATA_DIR: text('.data'),
  EMBEDDED_POSTGRES_PORT: integer('EMBEDDED_POSTGRES_PORT', 54329, 1, 65535),
});

export interface Config {
  /** Postgres connection string; undefined means "use the embedded database" where that is allowed. */
  readonly databaseUrl: string | undefined;
  readonly port: number;
  /** API processes sharing PORT (one Node process uses one core). */
  readonly apiProcesses: number;
  readonly host: string;
  readonly logLevel: 'fatal' | 'error' | 'warn' | 'info' | 'debug' | 'trace' | 'silent';

  /** How long a wait=true request is held open before it falls back to the acknowledgement. */
  readonly waitTimeoutMs: number;
  readonly maxBodyBytes: number;
  readonly signatures: 'required' | 'optional';
  /**
   * The 32-byte keys of signing secrets and webhook secrets at rest (SECRET_ENCRYPTION_KEYS, or
   * SECRET_ENCRYPTION_KEY): the first encrypts, every one may decrypt (the others: keys being
   * rotated out). Empty until set.
   */
  readonly secretEncryptionKeys: readonly Buffer[];
  /**
   * Where GET /metrics is served: a port of its own (METRICS_PORT; 0 picks a free one), or the
   * API's (and a worker's health) port when only METRICS_TOKEN is set; with neither, nowhere.
   */
  readonly metricsPort: number | undefined;
  /** When set, GET /metrics requires "Authorization: Bearer <token>", wherever it is served. */
  readonly metricsToken: string | undefined;

  /** Where live requests go: UPSTREAMS_FILE's upstreams, or one built from UPSTREAM_BASE_URL and UPSTREAM_API_KEY. */
  readonly upstreams: readonly Upstream[];
  readonly upstreamTimeoutMs: number;
  /** An upstream answer larger than this is upstream_invalid_response, read no further. */
  readonly upstreamMaxResponseBytes: number;
  /**
   * The memory a worker process gives to upstream answers larger than 16 KB while it reads them,
   * all calls together; an answer that does not find its share free waits for it.
   */
  readonly upstreamAnswerMemoryBytes: number;
  /** Live upstream calls a worker process keeps in flight at most: MAX_IN_FLIGHT, or UPSTREAM_MEMORY_MB's worth. */
  readonly maxInFlight: number;
  /** Test-mode (simulated) calls a worker process keeps in flight at most, apart from the live ones. */
  readonly testMaxInFlight: number;
  /** The longest test-delay-<ms> accepted: UPSTREAM_TIMEOUT_MS, at most 600000. */
  readonly testDelayMaxMs: number;
  /**
   * Live models that no upstream lists by name (only a pattern serves them) that may have a queue
   * at once, across the gateway; a request for another such model is refused.
   */
  readonly maxPatternModels: number;
  /** A queue that no request refers to, unused this long, is deleted with its lanes. */
  readonly pruneIdleQueuesAfterMs: number;

  /** Intake limits per API key (undefined: none): submissions per second (burst twice that), and lookups. */
  readonly rateLimitRps: number | undefined;
  readonly lookupRateLimitRps: number | undefined;
  /** Request body bytes per second per API key (undefined: no limit); bursts of twice that, or MAX_BODY_BYTES if more. */
  readonly rateLimitBytesPerSecond: number | undefined;
  /** Requests of a project and mode not yet finished, at most (undefined: no limit). */
  readonly maxUnfinishedPerProject: number | undefined;

  readonly webhooks: {
    /** Endpoints may resolve to loopback, private and link-local addresses (tests, private networks). */
    readonly allowPrivate: boolean;
    /** A try without a complete answer by then fails. */
    readonly timeoutMs: number;
    /** The waits between tries, in ms: one retry each (jittered, and never shorter than a retry-after). */
    readonly retryScheduleMs: readonly number[];
    /** Deliveries a worker process has under way at once. */
    readonly maxInFlight: number;
    /** Deliveries a worker process has under way at once to one endpoint. */
    readonly maxInFlightPerEndpoint: number;
  };

  /**
   * How long a request may take to finish, from its acceptance, unless its key has a shorter
   * deadline of its own; past it, the request fails with deadline_exceeded (its call, if one runs, aborted).
   */
  readonly requestDeadlineMs: number;
  readonly maxAttempts: number;
  /** Full-jitter exponential backoff: attempt n waits a random time in [0, min(max, base * 2^(n-1))]. */
  readonly retryBaseMs: number;
  readonly retryMaxMs: number;

  /** Finished requests created this many days ago are deleted. */
  readonly retentionDays: number;
  /** When set, finished requests' bodies are dropped after this many hours. */
  readonly bodyRetentionHours: number | undefined;

  /** graphile-worker jobs a worker process runs at once: dispatches and periodic tasks, all short. */
  readonly workerConcurrency: number;
  readonly workerPollIntervalMs: number;
  /** A worker pool not heard from for this long is presumed dead and its jobs released. */
  readonly workerDeadAfterMs: number;
  /** On shutdown, how long running attempts may take before they are aborted and handed back. */
  readonly shutdownGraceMs: number;
  readonly databasePoolSize: number;
  readonly workerPoolSize: number;

  /** Credentials and address `gateway request` calls the API with (it is a client, not the server). */
  readonly client: { apiKey: string | undefined; signingSecret: string | undefined; baseUrl: string };

  /** Where the embedded Postgres and other local state live when DATABASE_URL is unset. */
  readonly dataDir: string;
  readonly embeddedPostgresPort: number;
}

export class ConfigError extends Error {
  override name = 'ConfigError';
}

export function loadConfig(env: Record<string, string | undefined> = process.env): Config {
  const parsed = v.safeParse(Environment, env);
  if (!parsed.success) {
    throw invalidSettings(
      parsed.issues.map((issue) => {
        const key = issue.path?.map((item) => String(item.key)).join('.') ?? '';
        return issue.message.startsWith(key) ? issue.message : `${key}: ${issue.message}`;
      }),
    );
  }
  const e = parsed.output;
  // The checks across variables, each adding its problem to the one message.
  const problems: string[] = [];
  if (e.METRICS_PORT !== undefined && e.METRICS_PORT !== 0 && e.METRICS_PORT === e.PORT) {
    problems.push(`METRICS_PORT (${e.METRICS_PORT}) must not be PORT: metrics are served apart from the API`);
  }
  if (e.SHUTDOWN_GRACE_MS >= e.WORKER_DEAD_AFTER_MS) {
    // A worker stopping past its dead-after time could see its calls, still under way, recovered
    // by another as lost, and run twice.
    problems.push(`SHUTDOWN_GRACE_MS (${e.SHUTDOWN_GRACE_MS}) must be below WORKER_DEAD_AFTER_MS (${e.WORKER_DEAD_AFTER_MS})`);
  }
  if (e.DATABASE_URL !== undefined) {
    const problem = databaseUrlProblem(e.DATABASE_URL);
    if (problem !== undefined) problems.push(problem);
  }
  const secretEncryptionKeys = parseEncryptionKeys(e.SECRET_ENCRYPTION_KEY, e.SECRET_ENCRYPTION_KEYS, problems);
  const upstreams = loadUpstreams(e.UPSTREAMS_FILE, env, e.UPSTREAM_BASE_URL, e.UPSTREAM_API_KEY, problems);
  if (problems.length > 0) throw invalidSettings(problems);
  return Object.freeze({
    databaseUrl: e.DATABASE_URL,
    port: e.PORT,
    apiProcesses: e.API_PROCESSES,
    host: e.HOST,
    logLevel: e.LOG_LEVEL,
    waitTimeoutMs: e.WAIT_TIMEOUT_MS,
    maxBodyBytes: e.MAX_BODY_BYTES,
    signatures: e.SIGNATURES,
    secretEncryptionKeys,
    metricsPort: e.METRICS_PORT,
    metricsToken: e.METRICS_TOKEN,
    upstreams,
    upstreamTimeoutMs: e.UPSTREAM_TIMEOUT_MS,
    upstreamMaxResponseBytes: e.UPSTREAM_MAX_RESPONSE_BYTES,
    upstreamAnswerMemoryBytes: e.UPSTREAM_ANSWER_MEMORY_MB * 1024 * 1024,
    maxInFlight: e.MAX_IN_FLIGHT ?? Math.floor((e.UPSTREAM_MEMORY_MB * 1024) / MEMORY_PER_CALL_KB),
    testMaxInFlight: e.TEST_MAX_IN_FLIGHT,
    testDelayMaxMs: Math.min(e.UPSTREAM_TIMEOUT_MS, TEST_DELAY_CEILING_MS),
    maxPatternModels: e.MAX_PATTERN_MODELS,
    pruneIdleQueuesAfterMs: e.PRUNE_IDLE_QUEUES_AFTER,
    rateLimitRps: e.RATE_LIMIT_RPS,
    lookupRateLimitRps: e.LOOKUP_RATE_LIMIT_RPS ?? (e.RATE_LIMIT_RPS === undefined ? undefined : 10 * e.RATE_LIMIT_RPS),
    rateLimitBytesPerSecond: e.RATE_LIMIT_BYTES_PER_SECOND,
    maxUnfinishedPerProject: e.MAX_UNFINISHED_PER_PROJECT,
    webhooks: Object.freeze({
      allowPrivate: e.WEBHOOK_ALLOW_PRIVATE === 'true',
      timeoutMs: e.WEBHOOK_TIMEOUT_MS,
      retryScheduleMs: e.WEBHOOK_RETRY_SCHEDULE,
      maxInFlight: e.WEBHOOK_MAX_IN_FLIGHT,
      maxInFlightPerEndpoint: e.WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT,
    }),
    requestDeadlineMs: e.REQUEST_DEADLINE,
    maxAttempts: e.MAX_ATTEMPTS,
    retryBaseMs: e.RETRY_BASE_MS,
    retryMaxMs: Math.max(e.RETRY_MAX_MS, e.RETRY_BASE_MS),
    retentionDays: e.RETENTION_DAYS,
    bodyRetentionHours: e.BODY_RETENTION_HOURS,
    workerConcurrency: e.WORKER_CONCURRENCY,
    workerPollIntervalMs: e.WORKER_POLL_INTERVAL_MS,
    workerDeadAfterMs: e.WORKER_DEAD_AFTER_MS,
    shutdownGraceMs: e.SHUTDOWN_GRACE_MS,
    databasePoolSize: e.DATABASE_POOL_SIZE,
    workerPoolSize: e.WORKER_POOL_SIZE,
    client: Object.freeze({
      apiKey: e.GATEWAY_API_KEY,
      signingSecret: e.GATEWAY_SIGNING_SECRET,
      baseUrl: e.GATEWAY_BASE_URL.replace(/\/+$/, ''),
    }),
    dataDir: e.DATA_DIR,
    embeddedPostgresPort: e.EMBEDDED_POSTGRES_PORT,
  });
}

/**
 * What pg makes of DATABASE_URL that would fail every connection alike, found as pg builds a
 * client: a file of its TLS parameters (sslrootcert, sslcert, sslkey), which pg reads for each
 * connection, that cannot be read (its failure, a file's system error, was taken for the database
 * out of reach and waited for), and a port that is none (`?port=abc`: pg's pool then never ends).
 * The messages name a file, never the URL, which may hold a password.
 */
function databaseUrlProblem(url: string): string | undefined {
  let client: pg.Client;
  try {
    client = new pg.Client({ connectionString: url });
  } catch (error) {
    const failure = error as NodeJS.ErrnoException;
    return failure.path !== undefined
      ? `DATABASE_URL names a file that cannot be read: ${failure.message}`
      : `DATABASE_URL: ${failure.message}`;
  }
  if (!Number.isInteger(client.port) || client.port < 1 || client.port > 65_535) {
    return "DATABASE_URL's port must be a whole number from 1 to 65535";
  }
  return undefined;
}

const invalidSettings = (problems: readonly string[]) => new ConfigError(`Invalid settings:\n  ${problems.join('\n  ')}`);

/** The upstreams live requests go to; none, with the problem added to `problems`, when UPSTREAMS_FILE is bad. */
function loadUpstreams(
  file: string | undefined,
  env: Record<string, string | undefined>,
  baseUrl: string,
  apiKey: string | undefined,
  problems: string[],
): readonly Upstream[] {
  if (file === undefined) return [defaultUpstream(baseUrl, apiKey)];
  try {
    return loadUpstreamsFile(file, env);
  } catch (error) {
    if (!(error instanceof UpstreamsFileError)) throw error;
    problems.push(`UPSTREAMS_FILE: ${error.message}`);
    return [];
  }
}

/**
 * SECRET_ENCRYPTION_KEY (one key), or SECRET_ENCRYPTION_KEYS (the key that encrypts, then keys
 * that only decrypt: the ones being rotated out); never both, so that no one wonders which wins.
 * What is wrong is added to `problems`.
 */
function parseEncryptionKeys(single: string | undefined, list: string | undefined, problems: string[]): readonly Buffer[] {
  if (single !== undefined && list !== undefined) {
    problems.push(
      'SECRET_ENCRYPTION_KEY and SECRET_ENCRYPTION_KEYS are both set: set only SECRET_ENCRYPTION_KEYS ' +
        '(the key that encrypts first, then the keys that still decrypt), or only SECRET_ENCRYPTION_KEY',
    );
    return Object.freeze([]);
  }
  const named =
    single !== undefined
      ? [{ name: 'SECRET_ENCRYPTION_KEY', value: single }]
      : (list?.split(',') ?? []).map((item, index) => ({ name: `SECRET_ENCRYPTION_KEYS (key ${index + 1})`, value: item.trim() }));
  const keys: Buffer[] = [];
  for (const { name, value } of named) {
    const key = /^[0-9a-fA-F]{64}$/.test(value) ? Buffer.from(value, 'hex') : Buffer.from(value, 'base64');
    if (key.length === 32) {
      keys.push(key);
    } else {
      problems.push(
        `${name} must be 32 bytes, written as 64 hex digits or in base64 ` +
          '(for example the output of `openssl rand -base64 32`)',
      );
    }
  }
  return Object.freeze(keys);
}
