// `make test`: one real Postgres for the whole run (DATABASE_URL's server, or an embedded one
// under .data/ when it is unset), a template database migrated once, then tap. Each test file
// clones the template into a database of its own (test/helpers/database.ts).
import { spawn } from 'node:child_process';
import { existsSync, statSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import os from 'node:os';
import path from 'node:path';
import { loadConfig } from '../src/config.ts';
import { migrate } from '../src/db/migrate.ts';
import { createPool } from '../src/db/pool.ts';
import { createLogger } from '../src/logger.ts';
import { adminQuery, urlForDatabase } from '../test/helpers/database.ts';
import { scriptPostgres } from './scratch-postgres.ts';

const config = loadConfig();
const logger = createLogger({ logLevel: 'warn' }, process.stderr);

const server = await scriptPostgres(config, logger);
const { adminUrl } = server;
const template = `gateway_test_template_${randomBytes(4).toString('hex')}`;

let exitCode = 1;
try {
  await adminQuery(adminUrl, (client) => client.query(`create database ${template}`));
  const pool = createPool(urlForDatabase(adminUrl, template), { max: 2, applicationName: 'gateway-test-setup', logger });
  await migrate(pool, logger).finally(() => pool.end());

  exitCode = await runTap(process.argv.slice(2).map(testFilesOf), {
    GATEWAY_TEST_ADMIN_URL: adminUrl,
    GATEWAY_TEST_TEMPLATE: template,
    // Every test file, gateway process and command the suite starts (hundreds of them) strips
    // the types of the same sources; Node's compile cache keeps the result, and the bytecode,
    // for the next one. Node checks each entry against the source it was made from.
    NODE_COMPILE_CACHE: process.env.NODE_COMPILE_CACHE ?? path.join(os.tmpdir(), 'node-compile-cache'),
  });
} finally {
  await adminQuery(adminUrl, (client) => client.query(`drop database if exists ${template}`)).catch((error) =>
    logger.warn({ err: error }, 'could not drop the template database'),
  );
  await server.stop();
}
process.exit(exitCode);

/** `npm test -- test/client` runs that directory's test files (tap alone would find none: its
 * file-finding does not know .ts without its ts-node plugin, which we replace by Node's own
 * type stripping). */
function testFilesOf(arg: string): string {
  return existsSync(arg) && statSync(arg).isDirectory() ? `${arg.replace(/\/+$/, '')}/**/*.test.ts` : arg;
}

function runTap(args: string[], env: Record<string, string>): Promise<number> {
  // CI reads tap's plain TAP output (its closing "# { total, pass, fail }" line).
  const reporter = process.env.CI ? ['--reporter=tap'] : [];
  const child = spawn('tap', [...reporter, ...args], { stdio: 'inherit', env: { ...process.env, ...env } });
  return new Promise((resolve) => child.on('exit', (code, signal) => resolve(code ?? (signal ? 1 : 0))));
}
