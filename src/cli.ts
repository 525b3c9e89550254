#!/usr/bin/env node
// gateway: the command line (docs/cli.md). From a checkout: npm run gateway -- <command>.
// This file picks the command; src/cli/ parses its arguments, and main.ts runs it.
import './heap.ts'; // first: V8 settings that must precede any allocation
import * as v from 'valibot';
import { UsageError } from './cli/args.ts';
import { parseKeysCommand } from './cli/keys.ts';
import { migrateCommand } from './cli/migrate.ts';
import { runRequestCommand } from './cli/request.ts';
import { parseRequestsCommand, parseStatsCommand } from './cli/requests.ts';
import { serveCommand, startCommand } from './cli/serve.ts';
import { parseUpstreamsCommand } from './cli/upstreams.ts';
import { parseUsageCommand } from './cli/usage.ts';
import { parseWebhooksCommand } from './cli/webhooks.ts';
import { CommandError } from './cli/output.ts';
import { ConfigError, loadConfig } from './config.ts';
import { MigrationChangedError } from './db/migrate.ts';
import { MissingEncryptionKeyError } from './keys/service.ts';
import { isClusterChild, runAdminCommand, serveClusterChild } from './main.ts';

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

async function main(argv: string[]): Promise<void> {
  const [command, ...rest] = argv;
  const config = loadConfig();
  if (isClusterChild()) return serveClusterChild(config);
  switch (command) {
    case 'serve':
      return serveCommand(config, rest);
    case 'start':
      return startCommand(config, rest);
    case 'migrate':
      return runAdminCommand(config, migrateCommand, { anySchema: true });
    case 'keys':
      return runAdminCommand(config, parseKeysCommand(rest));
    case 'webhooks':
      return runAdminCommand(config, parseWebhooksCommand(rest));
    case 'request':
      return runRequestCommand(config, rest);
    case 'requests':
      return runAdminCommand(config, parseRequestsCommand(rest));
    case 'stats':
      return runAdminCommand(config, parseStatsCommand(rest));
    case 'upstreams':
      return runAdminCommand(config, parseUpstreamsCommand(rest));
    case 'usage':
      return runAdminCommand(config, parseUsageCommand(rest));
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

main(process.argv.slice(2)).catch((error: unknown) => {
  if (error instanceof UsageError) {
    console.error(`${error.message}\n\n${USAGE}`);
    process.exit(2);
  }
  if (
    error instanceof CommandError ||
    error instanceof ConfigError ||
    error instanceof MigrationChangedError ||
    error instanceof MissingEncryptionKeyError ||
    error instanceof v.ValiError
  ) {
    console.error(error.message);
    process.exit(1);
  }
  console.error(error);
  process.exit(1);
});
