// The command line's commands (docs/cli.md), run on given arguments, settings and output: src/cli.ts
// runs them for the process (its argv, environment, stdout and stderr, exit code), and the tests
// run them inside the test's process. This picks the command; the other files of src/cli/ parse
// its arguments, and main.ts runs it.
import { inspect } from 'node:util';
import pg from 'pg';
import * as v from 'valibot';
import { ConfigError, loadConfig } from '../config.ts';
import { EmbeddedPostgresError } from '../db/embedded.ts';
import { MigrationChangedError } from '../db/migrate.ts';
import { MissingEncryptionKeyError } from '../keys/service.ts';
import { errorCode, findCause, isTlsFailure, isUnreachable } from '../network-errors.ts';
import { isClusterChild, runAdminCommand, serveClusterChild, type AdminCommand } from '../main.ts';
import { UsageError } from './args.ts';
import { parseKeysCommand } from './keys.ts';
import { migrateCommand } from './migrate.ts';
import { CommandError, whyNotConnected, type CommandLineIo } from './output.ts';
import { runRequestCommand } from './request.ts';
import { parseRequestsCommand, parseStatsCommand } from './requests.ts';
import { serveCommand, startCommand } from './serve.ts';
import { parseUpstreamsCommand } from './upstreams.ts';
import { parseUsageCommand } from './usage.ts';
import { parseWebhooksCommand } from './webhooks.ts';

const USAGE = `Usage: gateway <command>

  migrate                      apply the database schema (safe to run from several processes)
  serve [--role all|api|worker]
                               run the API and/or the worker (DATABASE_URL required)
  start                        migrate and serve everything; with DATABASE_URL unset, on an
                               embedded Postgres under .data/ (what \`make run\` does)
  keys create --project <name> [--mode live|test] [--deadline <duration>] [--json]
                               create a key (and its project if needed); prints its id, the
                               key and its signing secret, once. --deadline (15m, 2h, 90s, from
                               1s to 30d): its requests fail if not finished that long after
                               they are accepted (REQUEST_DEADLINE when that is shorter)
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

Settings are environment variables; see docs/settings.md.`;

/**
 * Runs `gateway <argv>` with `io`'s settings and output, and resolves to its exit code: 0 done
 * (`serve` and `start` resolve once serving, and run until a signal stops them), 1 a failure (on
 * `io.err`: the message of one the user can act on, in one line for a database that refuses or
 * cannot be reached and a port in use, anything else with its stack; or a `request` answered
 * with no success), 2 a usage error (with the usage).
 */
export async function runCommandLine(argv: string[], io: CommandLineIo): Promise<number> {
  try {
    return await run(argv, io);
  } catch (error) {
    if (error instanceof UsageError) {
      io.err(`${error.message}\n\n${USAGE}`);
      return 2;
    }
    if (
      error instanceof CommandError ||
      error instanceof ConfigError ||
      error instanceof MigrationChangedError ||
      error instanceof EmbeddedPostgresError ||
      error instanceof MissingEncryptionKeyError ||
      error instanceof v.ValiError
    ) {
      if (error instanceof CommandError && error.output !== undefined) io.out(error.output);
      io.err(error.message);
      return 1;
    }
    io.err(outsideFailure(error) ?? inspect(error));
    return 1;
  }
}

/**
 * One line for a failure of what the command works with rather than of its code: the database's
 * refusal, with its SQLSTATE (a database or role that does not exist, a wrong password, a value
 * it does not take), a connection that could not be made (to the database: `request` says its
 * own) or that the database will never take as DATABASE_URL sets it up (TLS it does not have, a
 * password it needs), or a port another process listens on. Undefined for anything else, which is printed with
 * its stack.
 */
function outsideFailure(error: unknown): string | undefined {
  if (error instanceof pg.DatabaseError && error.code !== undefined) {
    return `The database refused: ${error.message} (SQLSTATE ${error.code}).`;
  }
  if (errorCode(error) === 'EADDRINUSE') {
    const inUse = findCause(error, (cause) => (cause as { code?: unknown }).code === 'EADDRINUSE') as Error;
    return `${inUse.message}: another process listens there; stop it, or set PORT (or METRICS_PORT) to another port.`;
  }
  if (isUnreachable(error)) return `Cannot connect: ${whyNotConnected(error)}.`;
  // What pg says of a connection the database will never take as DATABASE_URL sets it up.
  if (error instanceof Error && (isTlsFailure(error) || /^(The server does not support SSL connections|SASL: )/.test(error.message))) {
    return `Cannot connect to the database: ${error.message}.`;
  }
  return undefined;
}

async function run(argv: string[], io: CommandLineIo): Promise<number> {
  const [command, ...rest] = argv;
  const config = loadConfig(io.env);
  const admin = async (adminCommand: AdminCommand, options?: { anySchema?: boolean }) => {
    await runAdminCommand(config, io, adminCommand, options);
    return 0;
  };
  if (isClusterChild()) {
    await serveClusterChild(config);
    return 0;
  }
  switch (command) {
    case 'serve':
      await serveCommand(config, rest);
      return 0;
    case 'start':
      await startCommand(config, rest);
      return 0;
    case 'migrate':
      return admin(migrateCommand, { anySchema: true });
    case 'keys':
      return admin(parseKeysCommand(rest));
    case 'webhooks':
      return admin(parseWebhooksCommand(rest));
    case 'request':
      return (await runRequestCommand(config, rest, io)) ? 0 : 1;
    case 'requests':
      return admin(parseRequestsCommand(rest));
    case 'stats':
      return admin(parseStatsCommand(rest));
    case 'upstreams':
      return admin(parseUpstreamsCommand(rest));
    case 'usage':
      return admin(parseUsageCommand(rest));
    case undefined:
    case 'help':
    case '--help':
    case '-h':
      io.out(USAGE);
      return 0;
    default:
      throw new UsageError(`Unknown command "${command}".`);
  }
}
