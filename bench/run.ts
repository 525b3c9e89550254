// `make bench`: starts this checkout's gateway as real processes against Postgres, offers it
// signed load from a test key on loopback, and prints one table of figures beside their targets,
// then how each was measured. BENCHMARKS.md explains every figure.
//
// Each phase has a database of its own (cloned from a template migrated once), and its own
// gateway processes, so no phase inherits another's backlog; all are dropped at the end.
import { randomBytes } from 'node:crypto';
import { mkdir, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { PhaseContext, type PhaseResult, type Row, type RunContext } from './context.ts';
import { CpuMeter, waitForQuiet } from './cpu.ts';
import { gatewayCommand, running } from './gateway.ts';
import { describeMachine, gatewaySettingNames, machineLines } from './machine.ts';
import { acceptPhase } from './phases/accept.ts';
import { refusalsPhase } from './phases/refusals.ts';
import { ceilingPhase } from './phases/ceiling.ts';
import { endToEndPhase } from './phases/end-to-end.ts';
import { holdPhase } from './phases/hold.ts';
import { lookupPhase } from './phases/lookup.ts';
import { slowUpstreamPhase } from './phases/slow-upstream.ts';
import { waitPhase } from './phases/wait.ts';
import { openServer, withClient, type Server } from './postgres.ts';
import { loadSettings, nonDefault, USAGE, type Phase } from './settings.ts';
import { RequestSigner } from './signing.ts';

const RUNNERS: Record<Phase, (ctx: PhaseContext) => Promise<PhaseResult>> = {
  accept: acceptPhase,
  refusals: refusalsPhase,
  ceiling: ceilingPhase,
  'end-to-end': endToEndPhase,
  wait: waitPhase,
  lookup: lookupPhase,
  hold: holdPhase,
  'slow-upstream': slowUpstreamPhase,
};

// The order of the table: the request path's phases, then the slow upstream's.
const TABLE_ORDER: Phase[] = ['accept', 'end-to-end', 'wait', 'hold', 'lookup', 'refusals', 'ceiling', 'slow-upstream'];
const RATIO_TARGET = 3;
// Before each phase, up to this long for the machine to fall quiet (another test suite, the
// last phase's processes exiting).
const QUIET_CORES = 0.25;
const QUIET_TIMEOUT_MS = 20_000;

async function main(): Promise<number> {
  if (process.argv.includes('--help') || process.argv.includes('-h')) {
    console.log(USAGE);
    return 0;
  }
  const settings = loadSettings();
  const started = performance.now();
  const stamp = new Date().toISOString().replace(/\D/g, '').slice(0, 14);
  const runId = `bench_${stamp}_${randomBytes(3).toString('hex')}`;
  const runDir = path.join(settings.dataDir, 'bench', runId);
  await mkdir(runDir, { recursive: true });

  CpuMeter.prepare();
  const machine = describeMachine();
  const server = await openServer(settings.databaseUrl, settings.dataDir);
  const databases = new Set<string>();
  const cleanUp = cleanUpOnSignals(server, databases);
  try {
    const header = machineLines(machine, server.describe, command(settings.databaseUrl), await waitForQuiet(0, 0));
    header.push(
      `phases: ${settings.phases.join(', ')}; each measured for ${settings.durationMs / 1000} s after ${settings.warmupMs / 1000} s of warm-up; ` +
        `gateway processes: ${settings.topology.join(' + ')} (accept: api only; hold: api, then a worker; slow-upstream: api + worker)`,
    );
    for (const line of header) console.log(line);

    // The template: migrated and given a test key by the gateway's own command line.
    const secretEncryptionKey = randomBytes(32).toString('base64');
    const template = `${runId}_template`;
    await server.createDatabase(template);
    databases.add(template);
    const templateEnv = { databaseUrl: server.urlFor(template), secretEncryptionKey };
    await gatewayCommand(templateEnv, ['migrate']);
    const key = JSON.parse(
      await gatewayCommand(templateEnv, ['keys', 'create', '--project', 'bench', '--mode', 'test', '--json']),
    ) as { api_key: string; signing_secret: string };
    const credentials = { apiKey: key.api_key, signingSecret: key.signing_secret };
    await new RequestSigner(credentials, 'localhost').assertMatchesClientLibrary();

    const run: RunContext = { settings, server, template, runId, runDir, credentials, secretEncryptionKey };
    const results = new Map<Phase, PhaseResult>();
    for (const [index, phase] of settings.phases.entries()) {
      const phaseStarted = performance.now();
      process.stdout.write(`[${index + 1}/${settings.phases.length}] ${phase} ... `);
      await checkpoint(server);
      const busy = await waitForQuiet(QUIET_CORES, QUIET_TIMEOUT_MS);
      const ctx = new PhaseContext(run, phase);
      databases.add(ctx.database);
      let result: PhaseResult;
      try {
        await ctx.open();
        result = await RUNNERS[phase](ctx);
      } catch (error) {
        result = {
          rows: [{ figure: phase, result: 'FAILED', target: '', met: false }],
          details: [`** the phase failed: ${(error as Error).stack ?? String(error)} **`],
          data: { failed: String(error) },
        };
      }
      if (busy >= QUIET_CORES) {
        result.details.push(`** the machine was busy before this phase (${busy.toFixed(2)} cores for nothing of ours): its figures may be low **`);
      }
      result.details.push(...(await ctx.close()));
      databases.delete(ctx.database);
      results.set(phase, result);
      console.log(`${((performance.now() - phaseStarted) / 1000).toFixed(0)} s`);
    }

    const rows = tableRows(results);
    console.log('');
    console.log(renderTable(rows));
    console.log('');
    for (const phase of TABLE_ORDER) {
      const result = results.get(phase);
      if (!result) continue;
      console.log(`${phase}:`);
      for (const line of result.details) console.log(`  - ${line}`);
    }
    const file = path.join(runDir, 'results.json');
    await writeFile(
      file,
      `${JSON.stringify({ runId, header, settings: { ...settings, databaseUrl: undefined }, rows, phases: Object.fromEntries(results) }, null, 2)}\n`,
    );
    console.log('');
    console.log(`total time ${((performance.now() - started) / 1000).toFixed(0)} s; results and gateway logs in ${runDir}/`);
    return rows.some((row) => row.result === 'FAILED') ? 1 : 0;
  } finally {
    await cleanUp();
  }
}

function tableRows(results: Map<Phase, PhaseResult>): Row[] {
  const rows: Row[] = [];
  for (const phase of TABLE_ORDER) {
    rows.push(...(results.get(phase)?.rows ?? []));
    if (phase === 'ceiling') rows.push(...ceilingRatio(results));
  }
  return rows;
}

/** accept / ceiling, under the ceiling's row, when both phases ran. */
function ceilingRatio(results: Map<Phase, PhaseResult>): Row[] {
  const accept = results.get('accept')?.data.rps;
  const tps = results.get('ceiling')?.data.tps;
  if (typeof accept !== 'number' || typeof tps !== 'number' || tps <= 0) return [];
  const ratio = accept / tps;
  return [
    {
      figure: 'accept / ceiling',
      result: `${ratio.toFixed(2)}×`,
      target: `≥ ${RATIO_TARGET}×`,
      met: ratio >= RATIO_TARGET,
    },
  ];
}

function renderTable(rows: Row[]): string {
  const cells = [['figure', 'result', 'target', 'met'], ...rows.map((row) => [row.figure, row.result, row.target, met(row.met)])];
  const widths = [0, 1, 2, 3].map((column) => Math.max(...cells.map((cell) => cell[column]!.length)));
  const line = (cell: string[]) => `| ${cell.map((text, column) => text.padEnd(widths[column]!)).join(' | ')} |`;
  return [line(cells[0]!), `|${widths.map((width) => '-'.repeat(width + 2)).join('|')}|`, ...cells.slice(1).map(line)].join('\n');
}

function met(value: boolean | undefined): string {
  return value === undefined ? '' : value ? 'yes' : 'no';
}

/** How this run was started, with the settings that were given (a password hidden). */
function command(databaseUrl: string | undefined): string {
  const names = new Set(gatewaySettingNames());
  for (const own of ['DATABASE_URL', 'SECRET_ENCRYPTION_KEY', 'SECRET_ENCRYPTION_KEYS', 'PORT', 'METRICS_PORT', 'HOST', 'LOG_LEVEL', 'DATA_DIR']) {
    names.delete(own);
  }
  const given = Object.keys(process.env)
    .filter((name) => names.has(name) && process.env[name]?.trim())
    .sort()
    .map((name) => `${name}=${process.env[name]}`);
  const url = databaseUrl === undefined ? undefined : new URL(databaseUrl);
  if (url?.password) url.password = '***';
  const prefix = [...(url ? [`DATABASE_URL=${url.toString()}`] : []), ...nonDefault(), ...given];
  const invocation = process.env.MAKELEVEL ? 'make bench' : 'node bench/run.ts';
  return [...prefix, invocation].join(' ');
}

/** Postgres writes out what earlier phases dirtied now, rather than in the middle of the next. */
async function checkpoint(server: Server): Promise<void> {
  await withClient(server.adminUrl, (client) => client.query('checkpoint')).catch(() => {});
}

/** Drops the run's databases and ends its processes, at the end or when interrupted. */
function cleanUpOnSignals(server: Server, databases: Set<string>): () => Promise<void> {
  let done = false;
  const cleanUp = async () => {
    if (done) return;
    done = true;
    for (const gateway of running) gateway.kill();
    for (const database of databases) await server.dropDatabase(database).catch(() => {});
    await server.stop();
  };
  for (const signal of ['SIGINT', 'SIGTERM'] as const) {
    process.once(signal, () => {
      console.error(`\n${signal}: stopping the gateway processes and dropping the benchmark's databases`);
      void cleanUp().finally(() => process.exit(130));
    });
  }
  return cleanUp;
}

process.exitCode = await main().catch((error: unknown) => {
  console.error(error instanceof Error ? error.message : error);
  return 1;
});
