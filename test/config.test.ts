// Settings checked across variables: a bad start-up names every variable at fault in one message.
import t from 'tap';
import { loadConfig } from '../src/config.ts';

t.test('every fault across variables is named in one message', async (t) => {
  t.throws(
    () =>
      loadConfig({
        PORT: '9000',
        METRICS_PORT: '9000',
        SHUTDOWN_GRACE_MS: '8000',
        WORKER_DEAD_AFTER_MS: '7000',
        SECRET_ENCRYPTION_KEYS: 'abc,def',
        UPSTREAMS_FILE: '/nonexistent/upstreams.json',
      }),
    {
      name: 'ConfigError',
      message: [
        'Invalid settings:',
        '  METRICS_PORT (9000) must not be PORT: metrics are served apart from the API',
        '  SHUTDOWN_GRACE_MS (8000) must be below WORKER_DEAD_AFTER_MS (7000)',
        '  SECRET_ENCRYPTION_KEYS (key 1) must be 32 bytes, written as 64 hex digits or in base64 (for example the output of `openssl rand -base64 32`)',
        '  SECRET_ENCRYPTION_KEYS (key 2) must be 32 bytes, written as 64 hex digits or in base64 (for example the output of `openssl rand -base64 32`)',
        '  UPSTREAMS_FILE: Invalid upstreams file /nonexistent/upstreams.json: cannot be read (ENOENT)',
      ].join('\n'),
    },
  );
});

t.test('one fault is the message alone', async (t) => {
  t.throws(() => loadConfig({ SHUTDOWN_GRACE_MS: '7000' }), {
    message: 'Invalid settings:\n  SHUTDOWN_GRACE_MS (7000) must be below WORKER_DEAD_AFTER_MS (7000)',
  });
  t.throws(() => loadConfig({ PORT: 'x' }), { message: 'Invalid settings:\n  PORT must be a whole number' });
});

t.test('REQUEST_DEADLINE is a duration from 1s to 30d, 24h by default', async (t) => {
  t.equal(loadConfig({}).requestDeadlineMs, 86_400_000, '24 hours unless set');
  const deadlines = { '24h': 86_400_000, '15m': 900_000, '90s': 90_000, '1500ms': 1_500, '2000': 2_000, ' 2d ': 172_800_000, '30d': 2_592_000_000 };
  for (const [text, ms] of Object.entries(deadlines)) t.equal(loadConfig({ REQUEST_DEADLINE: text }).requestDeadlineMs, ms, text);

  const refused = {
    '': 'REQUEST_DEADLINE must be a duration such as 24h, 15m, 90s or 500ms (or a number of milliseconds)',
    '15 minutes': 'REQUEST_DEADLINE must be a duration such as 24h, 15m, 90s or 500ms (or a number of milliseconds)',
    '1.5h': 'REQUEST_DEADLINE must be a duration such as 24h, 15m, 90s or 500ms (or a number of milliseconds)',
    '-5m': 'REQUEST_DEADLINE must be a duration such as 24h, 15m, 90s or 500ms (or a number of milliseconds)',
    '999ms': 'REQUEST_DEADLINE must be at least 1s',
    '0': 'REQUEST_DEADLINE must be at least 1s',
    '31d': 'REQUEST_DEADLINE must be at most 30d',
    '99999999999999999999h': 'REQUEST_DEADLINE must be a duration such as 24h, 15m, 90s or 500ms (or a number of milliseconds)',
  };
  for (const [text, message] of Object.entries(refused)) {
    t.throws(() => loadConfig({ REQUEST_DEADLINE: text }), { name: 'ConfigError', message: `Invalid settings:\n  ${message}` }, JSON.stringify(text));
  }
});

t.test('MAX_PATTERN_MODELS is a whole number, 1000 by default; PRUNE_IDLE_QUEUES_AFTER a duration, 1h by default', async (t) => {
  t.match(loadConfig({}), { maxPatternModels: 1_000, pruneIdleQueuesAfterMs: 3_600_000 });
  t.match(loadConfig({ MAX_PATTERN_MODELS: '0', PRUNE_IDLE_QUEUES_AFTER: '10m' }), { maxPatternModels: 0, pruneIdleQueuesAfterMs: 600_000 });
  t.throws(() => loadConfig({ MAX_PATTERN_MODELS: 'many' }), { message: 'Invalid settings:\n  MAX_PATTERN_MODELS must be a whole number' });
  t.throws(() => loadConfig({ PRUNE_IDLE_QUEUES_AFTER: '500ms' }), { message: 'Invalid settings:\n  PRUNE_IDLE_QUEUES_AFTER must be at least 1s' });
});

t.test('DATABASE_URL is a postgres:// or postgresql:// URL, refused otherwise without its password', async (t) => {
  t.equal(loadConfig({}).databaseUrl, undefined, 'unset');
  t.equal(loadConfig({ DATABASE_URL: ' ' }).databaseUrl, undefined, 'empty is unset');
  for (const url of ['postgres://u:pw@127.0.0.1:5432/postgres', 'postgresql://db.example/gateway?sslmode=verify-full', 'postgres:///gateway?host=/var/run/postgresql']) {
    t.equal(loadConfig({ DATABASE_URL: ` ${url} ` }).databaseUrl, url, url);
  }
  const message =
    'Invalid settings:\n  DATABASE_URL must be a postgres:// or postgresql:// URL, such as postgres://user:password@host:5432/database ' +
    "(a password's reserved characters written as %XX)";
  for (const url of ['postgres://u:secret-pw@127.0.0.1:abc/postgres', 'u:secret-pw@127.0.0.1/postgres', 'mysql://u:secret-pw@127.0.0.1/db', 'postgres://u:secret-pw@[::1/db']) {
    t.throws(() => loadConfig({ DATABASE_URL: url }), { name: 'ConfigError', message }, url);
  }
});

t.test('LOG_LEVEL, SIGNATURES and WEBHOOK_ALLOW_PRIVATE are trimmed, as every value is', async (t) => {
  t.match(loadConfig({ LOG_LEVEL: ' debug ', SIGNATURES: 'optional\n', WEBHOOK_ALLOW_PRIVATE: '\ttrue ' }), {
    logLevel: 'debug',
    signatures: 'optional',
    webhooks: { allowPrivate: true },
  });
  t.throws(() => loadConfig({ WEBHOOK_ALLOW_PRIVATE: ' yes ' }), { message: 'Invalid settings:\n  WEBHOOK_ALLOW_PRIVATE must be true or false' });
});

t.test('a number of milliseconds that becomes a timer is at most 2^31 - 1, the longest a Node timer waits', async (t) => {
  const timers = {
    UPSTREAM_TIMEOUT_MS: 'upstreamTimeoutMs',
    WEBHOOK_TIMEOUT_MS: 'webhooks.timeoutMs',
    RETRY_BASE_MS: 'retryBaseMs',
    RETRY_MAX_MS: 'retryMaxMs',
    WORKER_POLL_INTERVAL_MS: 'workerPollIntervalMs',
    WORKER_DEAD_AFTER_MS: 'workerDeadAfterMs',
    SHUTDOWN_GRACE_MS: 'shutdownGraceMs',
  };
  for (const [name, key] of Object.entries(timers)) {
    // SHUTDOWN_GRACE_MS stays below WORKER_DEAD_AFTER_MS, so that one is set to the longest beside it.
    const env = name === 'SHUTDOWN_GRACE_MS' ? { WORKER_DEAD_AFTER_MS: '2147483647', SHUTDOWN_GRACE_MS: '2147483646' } : { [name]: '2147483647' };
    const config = loadConfig(env) as unknown as Record<string, unknown>;
    const value = key.split('.').reduce<unknown>((object, part) => (object as Record<string, unknown>)[part], config);
    t.equal(value, name === 'SHUTDOWN_GRACE_MS' ? 2_147_483_646 : 2_147_483_647, `${name} 2147483647 taken`);
    t.throws(() => loadConfig({ [name]: '2147483648' }), { name: 'ConfigError', message: `Invalid settings:\n  ${name} must be at most 2147483647` }, `${name} 2147483648 refused`);
  }
  t.throws(() => loadConfig({ UPSTREAM_TIMEOUT_MS: '3000000000' }), { message: 'Invalid settings:\n  UPSTREAM_TIMEOUT_MS must be at most 2147483647' });
  t.throws(() => loadConfig({ WAIT_TIMEOUT_MS: '600001' }), { message: 'Invalid settings:\n  WAIT_TIMEOUT_MS must be at most 600000' });
});
