#!/usr/bin/env node
// gateway: the command line (docs/cli.md). From a checkout: npm run gateway -- <command>.
// This file picks the command, and loads only that command's module: src/cli/ parses its
// arguments and runs the administrative ones (cli/admin.ts); main.ts runs the gateway. So `gateway
// keys list` loads neither the API, the worker nor graphile-worker.
import './heap.ts'; // first: V8 settings that must precede any allocation
import * as v from 'valibot';
import { UsageError } from './cli/args.ts';
import { CommandError } from './cli/output.ts';
import { ConfigError, loadConfig } from './config.ts';
import { MigrationChangedError } from './db/migrate.ts';
import { MissingEncryptionKeyError } from './keys/service.ts';
import { runAdminCommand } from './cli/admin.ts';
import { isClusterChild } from './cluster.ts';

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
  if (isClusterChild()) return (await import('./main.ts')).serveClusterChild(config);
  switch (command) {
    case 'serve':
      return (await import('./cli/serve.ts')).serveCommand(config, rest);
    case 'start':
      return (await import('./cli/serve.ts')).startCommand(config, rest);
    case 'migrate':
      return runAdminCommand(config, (await import('./cli/migrate.ts')).migrateCommand, { anySchema: true });
    case 'keys':
      return runAdminCommand(config, (await import('./cli/keys.ts')).parseKeysCommand(rest));
    case 'webhooks':
      return runAdminCommand(config, (await import('./cli/webhooks.ts')).parseWebhooksCommand(rest));
    case 'request':
      return (await import('./cli/request.ts')).runRequestCommand(config, rest);
    case 'requests':
      return runAdminCommand(config, (await import('./cli/requests.ts')).parseRequestsCommand(rest));
    case 'stats':
      return runAdminCommand(config, (await import('./cli/requests.ts')).parseStatsCommand(rest));
    case 'upstreams':
      return runAdminCommand(config, (await import('./cli/upstreams.ts')).parseUpstreamsCommand(rest));
    case 'usage':
      return runAdminCommand(config, (await import('./cli/usage.ts')).parseUsageCommand(rest));
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
