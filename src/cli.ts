#!/usr/bin/env node
// gateway: the command line (CONTRACT.md section 7). From a checkout: npm run gateway -- <command>.
import './heap.ts'; // first: V8 settings that must precede any allocation
import { parseArgs } from 'node:util';
import * as v from 'valibot';
import { createKeyCommand, listKeysCommand, reencryptKeysCommand, revokeKeyCommand } from './cli/keys.ts';
import { requestCommand } from './cli/request.ts';
import { listRequestsCommand, showRequestCommand, statsCommand } from './cli/requests.ts';
import { upstreamsCommand } from './cli/upstreams.ts';
import { usageCommand } from './cli/usage.ts';
import { addWebhookCommand, listWebhooksCommand, removeWebhookCommand, rotateWebhookSecretCommand } from './cli/webhooks.ts';
import { CommandError } from './cli/output.ts';
import { isClusterChild, shareMetricsWithPrimary, startCluster } from './cluster.ts';
import { loadConfig, type Config, ConfigError } from './config.ts';
import { migrate } from './db/migrate.ts';
import { createDb, createPool, type Db } from './db/pool.ts';
import { MissingEncryptionKeyError } from './keys/service.ts';
import { openDatabase, withLocalSecrets } from './local.ts';
import { createLogger, type Logger } from './logger.ts';
import { startGateway, type Role } from './main.ts';
import { stopOnSignals } from './signals.ts';

const USAGE = `Usage: gateway <command>

  migrate                      apply the database schema (safe to run from several processes)
  serve [--role all|api|worker]
                               run the API and/or the worker (DATABASE_URL required)
  start                        migrate and serve everything; with DATABASE_URL unset, on an
                               embedded Postgres under .data/ (what \`make run\` does)
  keys create --project <name> [--mode live|test] [--json]
                               create a key (and its project if needed); prints its id, the
                               key and its signing secret, once
  keys list [--project <name>] [--json]
  keys revoke <key id> [--json]
  keys reencrypt [--json]      encrypt every signing secret and webhook secret again with the
                               first of SECRET_ENCRYPTION_KEYS (safe to repeat, and to run
                               while the gateway runs)
  webhooks add --project <name> --url <url> [--events <event,...>] [--json]
                               send the project's request.completed, request.failed and
                               request.cancelled events (or those named) to the URL; prints the
                               endpoint's id and signing secret, once
  webhooks list [--project <name>] [--json]
  webhooks remove <endpoint id> [--json]
  webhooks rotate-secret <endpoint id> [--json]
                               a new signing secret, printed once; the old one keeps signing
                               beside it for 24 hours
  requests show <id> [--json]  one request and its attempts
  requests list [--status <s>] [--project <name>] [--mode live|test] [--limit <n>] [--json]
                               requests, newest first (20 by default)
  stats [--json]               requests by status, the queue, the last hour's errors, worker pools
  upstreams [--json]           the upstreams of UPSTREAMS_FILE, and each lane's requests and limits
  usage [--project <name>] [--since <YYYY-MM-DD>] [--json]
                               completed requests and tokens per day, project, mode, upstream, model
  request <METHOD> <path> [body | - | @file] [--verbose]
                               one signed call to a running gateway, with the key and secret in
                               GATEWAY_API_KEY and GATEWAY_SIGNING_SECRET (GATEWAY_BASE_URL:
                               http://localhost:8080); --verbose shows what is signed

Settings are environment variables; see README.md.`;

const Day = v.pipe(
  v.string(),
  v.regex(/^\d{4}-\d{2}-\d{2}$/, '--since must be a day, YYYY-MM-DD'),
  v.check(isDay, '--since must be a day, YYYY-MM-DD'),
);

function isDay(text: string): boolean {
  const date = new Date(`${text}T00:00:00Z`);
  return !Number.isNaN(date.getTime()) && date.toISOString().startsWith(text);
}

class UsageError extends Error {
  override name = 'UsageError';
}

async function main(argv: string[]): Promise<void> {
  const [command, ...rest] = argv;
  const config = loadConfig();
  if (isClusterChild()) return serveClusterChild(config);
  switch (command) {
    case 'serve':
      return serve(config, rest);
    case 'start':
      return start(config, rest);
    case 'migrate':
      return adminCommand(config, async (_db, { pool, logger }) => {
        await migrate(pool, logger);
        return 'The database schema is up to date.';
      });
    case 'keys':
      return keys(config, rest);
    case 'webhooks':
      return webhooks(config, rest);
    case 'request':
      return request(config, rest);
    case 'requests':
      return requests(config, rest);
    case 'stats': {
      const { values } = parse(rest, { json: { type: 'boolean', default: false } });
      return adminCommand(config, (db) => statsCommand(db, { json: values.json! }));
    }
    case 'upstreams': {
      const { values } = parse(rest, { json: { type: 'boolean', default: false } });
      return adminCommand(config, (db) => upstreamsCommand(db, config.upstreams, { json: values.json! }));
    }
    case 'usage': {
      const { values } = parse(rest, {
        project: { type: 'string' },
        since: { type: 'string' },
        json: { type: 'boolean', default: false },
      });
      const since = values.since === undefined ? undefined : v.parse(Day, values.since);
      return adminCommand(config, (db) =>
        usageCommand(db, {
          json: values.json!,
          ...(values.project ? { project: values.project } : {}),
          ...(since ? { since } : {}),
        }),
      );
    }
    case undefined:
    case 'help':
    case '--help':
    case '-h':
      console.log(USAGE);
      return;
    default:
      throw new UsageError(`Unknown command "${command}".`);
  }
}

async function serve(config: Config, args: string[]): Promise<void> {
  const { values } = parse(args, { role: { type: 'string', default: 'all' } });
  const role = v.parse(v.picklist(['all', 'api', 'worker'], '--role must be all, api or worker'), values.role) as Role;
  if (config.databaseUrl === undefined) {
    throw new CommandError('DATABASE_URL is not set. (`make run` starts the gateway on an embedded Postgres instead.)');
  }
  const logger = createLogger(config);
  if (config.apiProcesses > 1 && role !== 'worker') {
    const processes = await startCluster({ config, logger, role, databaseUrl: config.databaseUrl, childEnv: {} });
    stopOnSignals(processes.stop, logger);
    return;
  }
  const gateway = await startGateway({ config, logger, role, databaseUrl: config.databaseUrl });
  stopOnSignals(gateway.stop, logger);
}

/** One of the API processes a cluster's primary forked (API_PROCESSES > 1). */
async function serveClusterChild(config: Config): Promise<void> {
  const logger = createLogger(config);
  // METRICS_PORT, when set, is the primary's: it serves everyone's metrics there.
  const gateway = await startGateway({ config, logger, role: 'api', databaseUrl: config.databaseUrl!, metricsPort: false });
  shareMetricsWithPrimary(gateway.metrics);
  // The primary decides when to stop (it relays SIGTERM); a Ctrl-C reaches it too.
  process.on('SIGINT', () => {});
  stopOnSignals(gateway.stop, logger, ['SIGTERM']);
}

async function start(baseConfig: Config, args: string[]): Promise<void> {
  parse(args, {});
  const logger = createLogger(baseConfig);
  const database = await openDatabase(baseConfig, logger);
  try {
    const config = database.embedded ? await withLocalSecrets(baseConfig) : baseConfig;
    const pool = createPool(database.url, { max: 2, applicationName: 'gateway-migrate', logger });
    await migrate(pool, logger).finally(() => pool.end());
    const gateway =
      config.apiProcesses > 1
        ? await startCluster({
            config,
            logger,
            role: 'all',
            databaseUrl: database.url,
            // The key generated under DATA_DIR, when none was set (a set one reaches them as it is).
            childEnv:
              baseConfig.secretEncryptionKey === undefined && config.secretEncryptionKey
                ? { SECRET_ENCRYPTION_KEY: config.secretEncryptionKey.toString('base64') }
                : {},
          })
        : await startGateway({ config, logger, role: 'all', databaseUrl: database.url });
    logger.info('ready; create a test key with: npm run gateway -- keys create --project demo --mode test');
    stopOnSignals(async () => {
      await gateway.stop();
      await database.release();
    }, logger);
  } catch (error) {
    await database.release();
    throw error;
  }
}

async function keys(config: Config, args: string[]): Promise<void> {
  const [subcommand, ...rest] = args;
  switch (subcommand) {
    case 'create': {
      const { values } = parse(rest, {
        project: { type: 'string' },
        mode: { type: 'string', default: 'live' },
        json: { type: 'boolean', default: false },
      });
      if (values.project === undefined) throw new UsageError('keys create needs --project <name>.');
      const mode = v.parse(v.picklist(['live', 'test'], '--mode must be live or test'), values.mode);
      return adminCommand(config, (db, { config: effective }) =>
        createKeyCommand(db, effective.secretEncryptionKey, { project: values.project!, mode, json: values.json! }),
      );
    }
    case 'list': {
      const { values } = parse(rest, { project: { type: 'string' }, json: { type: 'boolean', default: false } });
      return adminCommand(config, (db) =>
        listKeysCommand(db, { ...(values.project ? { project: values.project } : {}), json: values.json! }),
      );
    }
    case 'revoke': {
      const { values, positionals } = parse(rest, { json: { type: 'boolean', default: false } }, true);
      if (positionals.length !== 1) throw new UsageError('keys revoke needs exactly one key id.');
      return adminCommand(config, (db) => revokeKeyCommand(db, positionals[0]!, { json: values.json! }));
    }
    case 'reencrypt': {
      const { values } = parse(rest, { json: { type: 'boolean', default: false } });
      return adminCommand(config, (db, { config: effective }) =>
        reencryptKeysCommand(db, effective.secretEncryptionKeys, { json: values.json! }),
      );
    }
    default:
      throw new UsageError('keys takes create, list, revoke or reencrypt.');
  }
}

async function webhooks(config: Config, args: string[]): Promise<void> {
  const [subcommand, ...rest] = args;
  switch (subcommand) {
    case 'add': {
      const { values } = parse(rest, {
        project: { type: 'string' },
        url: { type: 'string' },
        events: { type: 'string' },
        json: { type: 'boolean', default: false },
      });
      if (values.project === undefined || values.url === undefined) throw new UsageError('webhooks add needs --project <name> and --url <url>.');
      const events = values.events?.split(',').map((event) => event.trim()).filter(Boolean);
      return adminCommand(config, (db, { config: effective }) =>
        addWebhookCommand(
          db,
          { encryptionKey: effective.secretEncryptionKey, allowPrivate: effective.webhooks.allowPrivate },
          { project: values.project!, url: values.url!, json: values.json!, ...(events ? { events } : {}) },
        ),
      );
    }
    case 'list': {
      const { values } = parse(rest, { project: { type: 'string' }, json: { type: 'boolean', default: false } });
      return adminCommand(config, (db) =>
        listWebhooksCommand(db, { ...(values.project ? { project: values.project } : {}), json: values.json! }),
      );
    }
    case 'remove': {
      const { values, positionals } = parse(rest, { json: { type: 'boolean', default: false } }, true);
      if (positionals.length !== 1) throw new UsageError('webhooks remove needs exactly one endpoint id.');
      return adminCommand(config, (db) => removeWebhookCommand(db, positionals[0]!, { json: values.json! }));
    }
    case 'rotate-secret': {
      const { values, positionals } = parse(rest, { json: { type: 'boolean', default: false } }, true);
      if (positionals.length !== 1) throw new UsageError('webhooks rotate-secret needs exactly one endpoint id.');
      return adminCommand(config, (db, { config: effective }) =>
        rotateWebhookSecretCommand(db, effective.secretEncryptionKey, positionals[0]!, { json: values.json! }),
      );
    }
    default:
      throw new UsageError('webhooks takes add, list, remove or rotate-secret.');
  }
}

async function requests(config: Config, args: string[]): Promise<void> {
  const [subcommand, ...rest] = args;
  switch (subcommand) {
    case 'show': {
      const { values, positionals } = parse(rest, { json: { type: 'boolean', default: false } }, true);
      if (positionals.length !== 1) throw new UsageError('requests show needs exactly one request id.');
      return adminCommand(config, (db) => showRequestCommand(db, positionals[0]!, { json: values.json! }));
    }
    case 'list': {
      const { values } = parse(rest, {
        status: { type: 'string' },
        project: { type: 'string' },
        mode: { type: 'string' },
        limit: { type: 'string', default: '20' },
        json: { type: 'boolean', default: false },
      });
      const filter = v.parse(
        v.object({
          status: v.optional(v.picklist(['queued', 'processing', 'retrying', 'completed', 'failed', 'cancelled'], '--status must be queued, processing, retrying, completed, failed or cancelled')),
          project: v.optional(v.string()),
          mode: v.optional(v.picklist(['live', 'test'], '--mode must be live or test')),
          limit: v.pipe(v.string(), v.regex(/^\d+$/, '--limit must be a whole number'), v.transform(Number), v.minValue(1, '--limit must be at least 1'), v.maxValue(10_000, '--limit is at most 10000')),
        }),
        values,
      );
      return adminCommand(config, (db) =>
        listRequestsCommand(db, {
          limit: filter.limit,
          json: values.json!,
          ...(filter.status ? { status: filter.status } : {}),
          ...(filter.project ? { project: filter.project } : {}),
          ...(filter.mode ? { mode: filter.mode } : {}),
        }),
      );
    }
    default:
      throw new UsageError('requests takes show or list.');
  }
}

async function request(config: Config, args: string[]): Promise<void> {
  const { values, positionals } = parse(args, { verbose: { type: 'boolean', default: false } }, true);
  const [method, path, body] = positionals;
  if (method === undefined || path === undefined || positionals.length > 3) {
    throw new UsageError('request needs a method and a path, and takes an optional body.');
  }
  const ok = await requestCommand(
    config.client,
    { method, path, body, verbose: values.verbose! },
    { out: (text) => console.log(text), err: (text) => console.error(text) },
  );
  if (!ok) process.exitCode = 1;
}

interface AdminContext {
  pool: ReturnType<typeof createPool>;
  logger: Logger;
  config: Config;
}

/**
 * Runs one administrative command against the database and prints what it returns. Logs go to
 * stderr, so that stdout (for --json) carries only the answer. With DATABASE_URL unset, the
 * embedded Postgres under DATA_DIR is used (started for the command if it is not running).
 */
async function adminCommand(config: Config, run: (db: Db, context: AdminContext) => Promise<string>): Promise<void> {
  const logger = createLogger({ logLevel: config.logLevel === 'info' ? 'warn' : config.logLevel }, process.stderr);
  const database = await openDatabase(config, logger);
  const effective = database.embedded ? await withLocalSecrets(config) : config;
  const pool = createPool(database.url, { max: 2, applicationName: 'gateway-cli', logger });
  try {
    console.log(await run(createDb(pool), { pool, logger, config: effective }));
  } finally {
    await pool.end();
    await database.release();
  }
}

type Options = NonNullable<Parameters<typeof parseArgs>[0]>['options'];

function parse<T extends Options>(args: string[], options: T, allowPositionals = false) {
  try {
    return parseArgs({ args, options: options as T & {}, allowPositionals, strict: true });
  } catch (error) {
    throw new UsageError((error as Error).message);
  }
}

main(process.argv.slice(2)).catch((error: unknown) => {
  if (error instanceof UsageError) {
    console.error(`${error.message}\n\n${USAGE}`);
    process.exit(2);
  }
  if (
    error instanceof CommandError ||
    error instanceof ConfigError ||
    error instanceof MissingEncryptionKeyError ||
    error instanceof v.ValiError
  ) {
    console.error(error.message);
    process.exit(1);
  }
  console.error(error);
  process.exit(1);
});
