// `make test`: one real Postgres for the whole run (DATABASE_URL's server, or an embedded one
// under .data/ when it is unset), a template database migrated once, then tap. Each test file
// clones the template into a database of its own (test/helpers/database.ts).
//
// tap runs in two rounds. First the files that may run beside others, `tap.jobs` of them at once:
// most wait far more than they compute (an upstream down for two minutes at four requests a
// second), and the rest are short. Then the files of `tap.serial`, one at a time with nothing
// beside them: those that time or load the machine, and would fail for want of CPU on two cores
// beside other files. tap alone runs a serial file only once every file before it has ended, so
// that a serial file among the others would hold the whole run up behind the slowest of them.
import { spawn } from 'node:child_process';
import { existsSync, globSync, readFileSync, statSync } from 'node:fs';
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
const tapConfig = (JSON.parse(readFileSync('package.json', 'utf8')) as { tap: { include: string[]; serial: string[] } }).tap;
const logger = createLogger({ logLevel: 'warn' }, process.stderr);

const server = await scriptPostgres(config, logger);
const { adminUrl } = server;
const template = `gateway_test_template_${randomBytes(4).toString('hex')}`;

let exitCode = 1;
try {
  await adminQuery(adminUrl, (client) => client.query(`create database ${template}`));
  const pool = createPool(urlForDatabase(adminUrl, template), { max: 2, applicationName: 'gateway-test-setup', logger });
  await migrate(pool, logger).finally(() => pool.end());

  const env = {
    GATEWAY_TEST_ADMIN_URL: adminUrl,
    GATEWAY_TEST_TEMPLATE: template,
    // Every test file, gateway process and command the suite starts (hundreds of them) strips
    // the types of the same sources; Node's compile cache keeps the result, and the bytecode,
    // for the next one. Node checks each entry against the source it was made from.
    NODE_COMPILE_CACHE: process.env.NODE_COMPILE_CACHE ?? path.join(os.tmpdir(), 'node-compile-cache'),
  };
  const { beside, alone } = rounds(testFiles(process.argv.slice(2)));
  // The second round runs whatever the first gave, so that one run reports every failure.
  const codes = [];
  if (beside.length > 0) codes.push(await runTap(beside, env));
  if (alone.length > 0) codes.push(await runTap(['--jobs=1', ...alone], env));
  exitCode = codes.find((code) => code !== 0) ?? 0;
} finally {
  await adminQuery(adminUrl, (client) => client.query(`drop database if exists ${template}`)).catch((error) =>
    logger.warn({ err: error }, 'could not drop the template database'),
  );
  await server.stop();
}
process.exit(exitCode);

/**
 * The test files that the arguments name (`npm test -- test/client` runs that directory's, a
 * glob its matches), or `tap.include`'s without arguments. tap alone would find none in a
 * directory: its file-finding does not know .ts without its ts-node plugin, which we replace by
 * Node's own type stripping.
 */
function testFiles(args: readonly string[]): string[] {
  const patterns = args.length > 0 ? args : tapConfig.include;
  const files = patterns.flatMap((arg) => {
    if (existsSync(arg)) return statSync(arg).isDirectory() ? globSync(`${arg.replace(/\/+$/, '')}/**/*.test.ts`) : [arg];
    const matches = globSync(arg);
    if (matches.length === 0) throw new Error(`no test file matches ${arg}`);
    return matches;
  });
  return [...new Set(files)].sort();
}

/** The files that may run beside others, and those of `tap.serial` (a directory or a file each). */
function rounds(files: readonly string[]): { beside: string[]; alone: string[] } {
  const serial = tapConfig.serial.map((entry) => {
    if (!existsSync(entry)) throw new Error(`tap.serial in package.json names ${entry}, which does not exist`);
    return path.resolve(entry) + path.sep;
  });
  const isSerial = (file: string) => serial.some((entry) => (path.resolve(file) + path.sep).startsWith(entry));
  return { beside: files.filter((file) => !isSerial(file)), alone: files.filter(isSerial) };
}

function runTap(args: string[], env: Record<string, string>): Promise<number> {
  // CI reads tap's plain TAP output (each round's closing "# { total, pass, fail }" line).
  const reporter = process.env.CI ? ['--reporter=tap'] : [];
  const child = spawn('tap', [...reporter, ...args], { stdio: 'inherit', env: { ...process.env, ...env } });
  return new Promise((resolve) => child.on('exit', (code, signal) => resolve(code ?? (signal ? 1 : 0))));
}
