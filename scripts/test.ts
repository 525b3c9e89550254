// `make test`: one real Postgres for the whole run (DATABASE_URL's server, or an embedded one
// under .data/ when it is unset), a template database migrated once, then tap. Each test file
// clones the template into a database of its own (test/helpers/database.ts). The last round has
// a Postgres 13 of its own, with its own template.
//
// tap runs in five rounds:
// 1. the files that may run beside others, `tap.jobs` of them at once: short, and timing nothing.
//    Those of LEADING, the longest (12 to 60 s), about half of the round's time together, go in a
//    tap run of their own with half of the jobs, beside a run of the rest with the other half: in
//    one run, in the order of their paths, the last of them started near the round's end and held
//    it up alone on a machine left half idle;
// 2. the few that take a minute or more (LONG), all at once: an upstream down for two minutes at
//    four requests a second, a webhook receiver down for thirty, a worker killed and waited for.
//    Each waits far more than it computes: together they use about one of two cores, and on a
//    slow machine nearly both. (Within the first round, the long files would start late, in the
//    order of the files' paths, and end it alone on an idle machine; beside its other files, some
//    failed their time bounds; and one after another they took twelve minutes.)
// 3. after them, the files of `tap.serial` one at a time: those that time or load the machine,
//    and would fail for want of CPU on two cores beside other files. Those of LOADED, which keep
//    both cores busy, last. (Beside the long files, on a machine twice as slow as the others, a
//    time bound of one file or another, serial or long, failed in four runs out of five. Fault
//    1 bounds a killed worker's calls to start again within 10 s of the kill: 7 s at most to find
//    it dead, then about 0.3 s on an idle machine; beside the long files, on a slow machine, that
//    0.3 s can take over 3 s.)
// 4. the files of ALONE, one at a time with nothing beside them: the noisy neighbour, whose
//    figure is a ratio of latencies that any other work on the machine skews, and the replanning
//    test, whose early plans any cluster-wide cache reset replaces.
// 5. the files of ON_POSTGRES_13 again, on a throw-away Postgres 13 (scripts/postgres-13.ts), the
//    oldest server the gateway supports, where the optional dependency that holds its binaries is
//    installed (linux-x64): the schema and every kind of statement the gateway runs, where a
//    feature newer than 13 would fail.
// (tap alone runs a serial file only once every file before it has ended: among the others,
// each would hold the run up behind the slowest of them.) Each round runs whatever the one
// before gave, so that one run reports every failure.
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
import { postgres13Binaries, startPostgres13 } from './postgres-13.ts';
import { scriptPostgres } from './scratch-postgres.ts';

/** Files that take a minute or more, mostly waiting: the second round, all at once (above). */
const LONG = [
  'test/db/listener.test.ts',
  'test/faults/4-chaos-upstream.test.ts',
  'test/faults/7-webhook-receiver-down.test.ts',
  'test/outages/503.test.ts',
  'test/outages/auth-refused.test.ts',
  'test/outages/brownout.test.ts',
  'test/outages/connection-refused.test.ts',
  'test/outages/fallback.test.ts',
  'test/outages/hang.test.ts',
  'test/outages/worker-killed-while-probing.test.ts',
  'test/worker/recording-outage.test.ts',
];

/** The longest files of the first round, about half of its time: a run of their own (above). */
const LEADING = [
  'test/cluster.test.ts',
  'test/faults/5-hostile-input.test.ts',
  'test/faults/9-kills-amid-races.test.ts',
  'test/http/held-contexts.test.ts',
  'test/keys/cache.test.ts',
  'test/lanes/health.test.ts',
  'test/outages/503-retry-after.test.ts',
  'test/outages/hang-other-upstream.test.ts',
  'test/outages/worker-restarted.test.ts',
  'test/requests/insert-batcher.test.ts',
  'test/webhooks/deliverer.test.ts',
  'test/webhooks/end-to-end.test.ts',
  'test/worker/lifecycle.test.ts',
  'test/worker/prune.test.ts',
  'test/worker/upstream-outcomes.test.ts',
];

/** Files of `tap.serial` that keep both cores busy: the last of the third round's (above). */
const LOADED = ['test/faults/3-postgres-outage.test.ts', 'test/requests/lookup-memory.test.ts'];
/** Files of `tap.serial` that nothing may run beside: the fourth round (above). */
const ALONE = ['test/db/replanning.test.ts', 'test/faults/8-noisy-neighbour.test.ts'];
/**
 * Files run again on Postgres 13 (the fifth round): the migrations, the schema and its views,
 * the gateway as a role without privileges, and the statements of intake, claims, attempts,
 * lanes, deadlines, retention and webhooks.
 */
const ON_POSTGRES_13 = [
  'test/db/migrations.test.ts',
  'test/db/plain-role.test.ts',
  'test/lanes/token-fair-share.test.ts',
  'test/requests/idempotency.test.ts',
  'test/schema.test.ts',
  'test/views.test.ts',
  'test/webhooks/deliverer.test.ts',
  'test/worker/deadlines.test.ts',
  'test/worker/finish-completions.test.ts',
  'test/worker/retention.test.ts',
];

const config = loadConfig();
const tapConfig = (JSON.parse(readFileSync('package.json', 'utf8')) as { tap: { include: string[]; serial: string[]; jobs: number } }).tap;
const logger = createLogger({ logLevel: 'warn' }, process.stderr);

const server = await scriptPostgres(config, logger);
let exitCode = 1;
try {
  // tap's own options (`npm test -- --grep=cancel test/requests`, each in its --name=value form)
  // go to every round; the other arguments name the files.
  const args = process.argv.slice(2);
  const options = args.filter((arg) => arg.startsWith('-'));
  const files = testFiles(args.filter((arg) => !arg.startsWith('-')));
  const { leading, beside, long, serial, loaded, alone, onPostgres13 } = rounds(files);
  const codes = await withTemplate(server.adminUrl, async (env) => {
    const codes = [];
    if (leading.length > 0 && beside.length > 0) {
      // Half of the jobs each; the second run's output is held, and printed once the first's ends.
      const jobs = `--jobs=${Math.max(1, Math.floor(tapConfig.jobs / 2))}`;
      const [first, second] = await Promise.all([
        runTap([jobs, ...options, ...leading], env),
        runTap([jobs, ...options, ...beside], env, { held: true }),
      ]);
      second.print();
      codes.push(first.code, second.code);
    } else if (leading.length + beside.length > 0) {
      codes.push((await runTap([...options, ...leading, ...beside], env)).code);
    }
    // The long files in one tap run; then the serial ones, in two runs after each other (tap runs
    // its files in the order of their paths).
    if (long.length > 0) codes.push((await runTap([`--jobs=${long.length}`, ...options, ...long], env)).code);
    for (const files of [serial, loaded]) {
      if (files.length > 0) codes.push((await runTap(['--jobs=1', ...options, ...files], env)).code);
    }
    if (alone.length > 0) codes.push((await runTap(['--jobs=1', ...options, ...alone], env)).code);
    return codes;
  });
  if (onPostgres13.length > 0) codes.push(...(await onPostgres13Round(onPostgres13, options)));
  exitCode = codes.find((code) => code !== 0) ?? 0;
} finally {
  await server.stop();
}
process.exit(exitCode);

/**
 * Runs the rounds given a template database on the server of `adminUrl`, migrated once: `run`
 * gets the environment that tells the test files where it is. The template is dropped after.
 */
async function withTemplate(adminUrl: string, run: (env: Record<string, string>) => Promise<number[]>): Promise<number[]> {
  const template = `gateway_test_template_${randomBytes(4).toString('hex')}`;
  try {
    await adminQuery(adminUrl, (client) => client.query(`create database ${template}`));
    const pool = createPool(urlForDatabase(adminUrl, template), { max: 2, applicationName: 'gateway-test-setup', logger });
    await migrate(pool, logger).finally(() => pool.end());
    return await run({
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
  }
}

/** The fifth round (above): `files` on a Postgres 13 of their own, two at a time. */
async function onPostgres13Round(files: readonly string[], options: readonly string[]): Promise<number[]> {
  const binaries = await postgres13Binaries();
  if (binaries === undefined) {
    console.log(`# Postgres 13 round not run: its binaries (the optional dependency postgres-13) are installed on linux-x64 only, not on ${process.platform}-${process.arch}`);
    return [];
  }
  const postgres13 = await startPostgres13(binaries);
  try {
    console.log(`# Postgres ${postgres13.version}: ${files.join(', ')}`);
    return await withTemplate(postgres13.adminUrl, async (env) => [(await runTap(['--jobs=2', ...options, ...files], env)).code]);
  } finally {
    await postgres13.stop();
  }
}

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

/** The files of each round: LEADING's and the rest of those that may run beside others; LONG's, and `tap.serial`'s but LOADED's and ALONE's, then LOADED's; ALONE's; ON_POSTGRES_13's. */
function rounds(files: readonly string[]): { leading: string[]; beside: string[]; long: string[]; serial: string[]; loaded: string[]; alone: string[]; onPostgres13: string[] } {
  const within = (entries: readonly string[], where: string) => {
    const prefixes = entries.map((entry) => {
      if (!existsSync(entry)) throw new Error(`${where} names ${entry}, which does not exist`);
      return path.resolve(entry) + path.sep;
    });
    return (file: string) => prefixes.some((prefix) => (path.resolve(file) + path.sep).startsWith(prefix));
  };
  const isSerial = within(tapConfig.serial, 'tap.serial in package.json');
  const isLeading = within(LEADING, 'LEADING in scripts/test.ts');
  const isLong = within(LONG, 'LONG in scripts/test.ts');
  const isLoaded = within(LOADED, 'LOADED in scripts/test.ts');
  const isAlone = within(ALONE, 'ALONE in scripts/test.ts');
  const isOnPostgres13 = within(ON_POSTGRES_13, 'ON_POSTGRES_13 in scripts/test.ts');
  for (const [name, entries] of Object.entries({ LOADED, ALONE })) {
    const outside = entries.find((entry) => !isSerial(entry));
    if (outside) throw new Error(`${name} in scripts/test.ts names ${outside}, which tap.serial in package.json does not`);
  }
  const outside = LEADING.find((entry) => isSerial(entry) || isLong(entry));
  if (outside) throw new Error(`LEADING in scripts/test.ts names ${outside}, which tap.serial or LONG names too`);
  return {
    leading: files.filter((file) => isLeading(file) && !isLong(file) && !isSerial(file)),
    beside: files.filter((file) => !isLeading(file) && !isLong(file) && !isSerial(file)),
    long: files.filter((file) => isLong(file) && !isSerial(file)),
    serial: files.filter((file) => isSerial(file) && !isLoaded(file) && !isAlone(file)),
    loaded: files.filter((file) => isLoaded(file) && !isAlone(file)),
    alone: files.filter(isAlone),
    onPostgres13: files.filter(isOnPostgres13),
  };
}

/** A tap run that has ended: its exit code, and print() writes what it held back, if anything. */
interface TapRun {
  code: number;
  print(): void;
}

function runTap(args: string[], env: Record<string, string>, { held = false } = {}): Promise<TapRun> {
  // CI reads tap's plain TAP output (each run's closing "# { total, pass, fail }" line).
  const reporter = process.env.CI ? ['--reporter=tap'] : [];
  const child = spawn('tap', [...reporter, ...args], {
    stdio: held ? ['ignore', 'pipe', 'pipe'] : 'inherit',
    env: { ...process.env, ...env },
  });
  const output: Buffer[] = [];
  const errors: Buffer[] = [];
  child.stdout?.on('data', (chunk: Buffer) => output.push(chunk));
  child.stderr?.on('data', (chunk: Buffer) => errors.push(chunk));
  const print = () => {
    process.stdout.write(Buffer.concat(output));
    process.stderr.write(Buffer.concat(errors));
  };
  return new Promise((resolve) =>
    child.on('close', (code, signal) => resolve({ code: code ?? (signal ? 1 : 0), print })),
  );
}
