// The benchmark's own settings: BENCH_* environment variables, read here only. Every other
// variable (WORKER_CONCURRENCY, DATABASE_POOL_SIZE, ...) passes through to the gateway.
import type { Role } from './gateway.ts';

// In the order they run: the ceiling right after accept, whose figure it is compared with; the
// two longest, which also open thousands of sockets, hold and slow-upstream, at the end.
export const PHASES = ['accept', 'ceiling', 'end-to-end', 'wait', 'lookup', 'refusals', 'hold', 'slow-upstream'] as const;
export type Phase = (typeof PHASES)[number];

export interface Settings {
  phases: Phase[];
  /** Measured window of each timed phase. */
  durationMs: number;
  warmupMs: number;
  /** Concurrent connections of the saturation phases (accept, end-to-end, lookups, refusals) and of slow-upstream's submissions. */
  connections: number;
  /** Offered rate of the wait=true overhead phase, requests per second. */
  waitRate: number;
  /** A low rate measured first: the overhead when nothing queues, and the gateway is quiet between requests. */
  waitReferenceRate: number;
  /** Simulated upstream time of the wait=true overhead phase (model test-delay-<ms>). */
  waitDelayMs: number;
  /** wait=true requests held open at once. */
  hold: number;
  /** wait=false requests of the slow-upstream phase, with a live key. */
  slowRequests: number;
  /** How long the slow-upstream phase's upstream takes to answer each call. */
  upstreamDelayMs: number;
  /** pgbench clients of the ceiling phase. */
  pgbenchClients: number;
  /** The gateway processes of the end-to-end, wait and lookup phases, e.g. ["all"] or ["api", "worker"]. */
  topology: Role[];
  /** Run the gateway with --cpu-prof and summarize the profiles in the report. */
  profile: boolean;
  databaseUrl: string | undefined;
  dataDir: string;
}

export const DEFAULTS = {
  durationMs: 15_000,
  warmupMs: 3_000,
  connections: 64,
  waitRate: 200,
  waitReferenceRate: 20,
  waitDelayMs: 50,
  hold: 10_000,
  slowRequests: 20_000,
  upstreamDelayMs: 2_000,
  pgbenchClients: 8,
};

export const USAGE = `node bench/run.ts (make bench): benchmarks the gateway of this checkout; see BENCHMARKS.md.

  BENCH_PHASES             comma-separated, default all: ${PHASES.join(',')}
  BENCH_DURATION           seconds measured per phase, at least 1 (default ${DEFAULTS.durationMs / 1000})
  BENCH_WARMUP             seconds of warm-up before each (default ${DEFAULTS.warmupMs / 1000})
  BENCH_CONNECTIONS        connections of the saturation phases and slow-upstream (default ${DEFAULTS.connections})
  BENCH_WAIT_RATE          requests/s of the wait=true overhead phase (default ${DEFAULTS.waitRate})
  BENCH_HOLD               wait=true requests held open at once (default ${DEFAULTS.hold})
  BENCH_SLOW_REQUESTS      wait=false requests of the slow-upstream phase (default ${DEFAULTS.slowRequests})
  BENCH_UPSTREAM_DELAY_MS  how long its loopback upstream takes to answer, ms (default ${DEFAULTS.upstreamDelayMs})
  BENCH_TOPOLOGY           gateway processes, e.g. all (default) or api+worker
  BENCH_PROFILE=1          run the gateway with --cpu-prof; the report names its busiest functions
  DATABASE_URL             the Postgres server to use (else an embedded one under .data/bench-postgres)
  Any other gateway setting (WORKER_CONCURRENCY, DATABASE_POOL_SIZE, ...) is passed to the gateway.`;

export function loadSettings(env: NodeJS.ProcessEnv = process.env): Settings {
  const phases = (env.BENCH_PHASES ?? PHASES.join(','))
    .split(',')
    .map((phase) => phase.trim())
    .filter(Boolean);
  for (const phase of phases) {
    if (!(PHASES as readonly string[]).includes(phase)) throw new Error(`BENCH_PHASES: unknown phase "${phase}"\n\n${USAGE}`);
  }
  const topology = (env.BENCH_TOPOLOGY ?? 'all').split('+').map((role) => role.trim());
  for (const role of topology) {
    if (role !== 'all' && role !== 'api' && role !== 'worker') throw new Error(`BENCH_TOPOLOGY: unknown role "${role}"\n\n${USAGE}`);
  }
  const serving = topology.filter((role) => role !== 'worker').length;
  const working = topology.filter((role) => role !== 'api').length;
  if (serving !== 1 || working < 1) {
    throw new Error('BENCH_TOPOLOGY needs exactly one process serving the API (all or api) and at least one running the worker');
  }
  return {
    phases: PHASES.filter((phase) => phases.includes(phase)),
    // At least a second: rates are divided by it, and its whole seconds counted one by one.
    durationMs: seconds(env, 'BENCH_DURATION', DEFAULTS.durationMs, 1),
    warmupMs: seconds(env, 'BENCH_WARMUP', DEFAULTS.warmupMs, 0),
    connections: whole(env, 'BENCH_CONNECTIONS', DEFAULTS.connections),
    waitRate: whole(env, 'BENCH_WAIT_RATE', DEFAULTS.waitRate),
    waitReferenceRate: DEFAULTS.waitReferenceRate,
    waitDelayMs: DEFAULTS.waitDelayMs,
    hold: whole(env, 'BENCH_HOLD', DEFAULTS.hold),
    slowRequests: whole(env, 'BENCH_SLOW_REQUESTS', DEFAULTS.slowRequests),
    upstreamDelayMs: whole(env, 'BENCH_UPSTREAM_DELAY_MS', DEFAULTS.upstreamDelayMs),
    pgbenchClients: DEFAULTS.pgbenchClients,
    topology: topology as Role[],
    profile: ['1', 'true', 'yes'].includes((env.BENCH_PROFILE ?? '').trim().toLowerCase()),
    databaseUrl: env.DATABASE_URL?.trim() || undefined,
    dataDir: env.DATA_DIR?.trim() || '.data',
  };
}

function seconds(env: NodeJS.ProcessEnv, name: string, fallback: number, least: number): number {
  const value = env[name];
  if (value === undefined || value.trim() === '') return fallback;
  const parsed = Number(value);
  if (!Number.isFinite(parsed) || parsed < least) throw new Error(`${name} must be a number of seconds, at least ${least}`);
  return Math.round(parsed * 1000);
}

function whole(env: NodeJS.ProcessEnv, name: string, fallback: number): number {
  const value = env[name];
  if (value === undefined || value.trim() === '') return fallback;
  const parsed = Number(value);
  if (!Number.isSafeInteger(parsed) || parsed < 1) throw new Error(`${name} must be a whole number of at least 1`);
  return parsed;
}

/** The settings that differ from the defaults, as they would be written on the command line. */
export function nonDefault(env: NodeJS.ProcessEnv = process.env): string[] {
  return Object.keys(env)
    .filter((name) => name.startsWith('BENCH_') && env[name]?.trim())
    .sort()
    .map((name) => `${name}=${env[name]}`);
}
