// Where the machine's CPU went during a measured window, read from /proc: the load generator
// (this process and its children, e.g. pgbench), the gateway's processes, the Postgres
// backends of the benchmark's database, Postgres's shared background processes, and everything
// else. "Everything else" is the noise check: another program busy on this two-core machine
// makes every figure of that window unreliable.
//
// /proc is read in a worker thread: a scan of every process takes milliseconds, and on the
// load generator's event loop it would delay requests and stamp answers late.
import { execFileSync } from 'node:child_process';
import { readdirSync, readFileSync } from 'node:fs';
import { isMainThread, parentPort, Worker } from 'node:worker_threads';
import { DISK_LOOK_MS, DiskWaitTally, processesWaitingOnDisk, type DiskWaitFigures } from '../scripts/disk-waits.ts';

export type CpuClass = 'generator' | 'gateway' | 'postgres' | 'other';

export interface CpuShares {
  seconds: number;
  /** The busiest processes of the "other" class, by name, in cores. */
  others: { name: string; cores: number }[];
  /** Cores used on average over the window, per class; `idle` is what was left of all cores. */
  cores: Record<CpuClass, number> & { idle: number; total: number };
  /** How long processes of the machine waited on the disk in the window (undefined: not Linux). */
  disk: DiskWaitFigures | undefined;
}

interface ProcessTimes {
  ticks: number;
  ppid: number;
  name: string;
  /** For the postmaster's children: the database a backend serves ('' for background processes). */
  database?: string;
}

let ticksPerSecond: number | undefined;

function clockTicks(): number {
  if (ticksPerSecond === undefined) {
    try {
      ticksPerSecond = Number(execFileSync('getconf', ['CLK_TCK'], { encoding: 'utf8' }).trim()) || 100;
    } catch {
      ticksPerSecond = 100;
    }
  }
  return ticksPerSecond;
}

/**
 * Every process's CPU time now. `databases` remembers which database each Postgres backend
 * serves (read once from its title) and forgets processes that have ended.
 */
function readProcesses(postmaster: number | undefined, databases: Map<number, string>): Map<number, ProcessTimes> {
  const processes = new Map<number, ProcessTimes>();
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    const pid = Number(entry);
    let stat: string;
    try {
      stat = readFileSync(`/proc/${entry}/stat`, 'latin1');
    } catch {
      continue; // exited meanwhile
    }
    // pid (comm) state ppid ... utime(14) stime(15); comm may hold spaces.
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    const ppid = Number(fields[1]);
    let database = databases.get(pid);
    if (database === undefined && postmaster !== undefined && ppid === postmaster) {
      database = databaseOf(pid);
      // Remembered once its title names it: until then it is read again at the next reading.
      if (database !== undefined) databases.set(pid, database);
    }
    const name = stat.slice(stat.indexOf('(') + 1, stat.lastIndexOf(')'));
    processes.set(pid, { ppid, name, ticks: Number(fields[11]) + Number(fields[12]), ...(database !== undefined ? { database } : {}) });
  }
  for (const pid of databases.keys()) if (!processes.has(pid)) databases.delete(pid);
  return processes;
}

function readTotals(): { busy: number; all: number } {
  const line = readFileSync('/proc/stat', 'latin1').split('\n', 1)[0]!;
  const values = line.trim().split(/\s+/).slice(1, 9).map(Number);
  const all = values.reduce((sum, value) => sum + value, 0);
  const idle = values[3]! + values[4]!; // idle + iowait
  return { busy: all - idle, all };
}

/** The pids of `roots` and all their descendants, in `processes`. */
export function descendants(processes: Map<number, { ppid: number }>, roots: Iterable<number>): Set<number> {
  const found = new Set<number>(roots);
  let grew = true;
  while (grew) {
    grew = false;
    for (const [pid, info] of processes) {
      if (!found.has(pid) && found.has(info.ppid)) {
        found.add(pid);
        grew = true;
      }
    }
  }
  return found;
}

export interface Classifier {
  /** Pids of the gateway processes started by the benchmark (their children are included). */
  gatewayPids(): number[];
  /** The postmaster of the cluster under test, if it runs on this machine. */
  postmasterPid: number | undefined;
  /** Name of the database under test: its backends count as "postgres", other databases' as "other". */
  database(): string;
}

// Processes are read again this often during a window, so that one that ends inside it (a
// pgbench backend, a short-lived connection) still has its time counted up to its last reading.
const SAMPLE_INTERVAL_MS = 500;

type Request =
  | { kind: 'begin'; id: number; postmasterPid: number | undefined }
  | { kind: 'end'; id: number; gatewayPids: number[]; database: string; generatorPid: number };

interface Reply {
  id: number;
  shares: CpuShares;
}

/** A measured window: from construction until end(). */
export class CpuMeter {
  static #sampler: Worker | undefined;
  static #nextId = 1;
  static readonly #pending = new Map<number, (shares: CpuShares) => void>();
  readonly #id = CpuMeter.#nextId++;
  readonly #classifier: Classifier;

  constructor(classifier: Classifier) {
    this.#classifier = classifier;
    CpuMeter.#send({ kind: 'begin', id: this.#id, postmasterPid: classifier.postmasterPid });
  }

  end(): Promise<CpuShares> {
    return new Promise((resolve) => {
      CpuMeter.#pending.set(this.#id, resolve);
      CpuMeter.#sampler!.ref();
      CpuMeter.#send({
        kind: 'end',
        id: this.#id,
        gatewayPids: this.#classifier.gatewayPids(),
        database: this.#classifier.database(),
        generatorPid: process.pid,
      });
    });
  }

  /** Starts the sampler thread ahead of the first window, so that window opens on time. */
  static prepare(): void {
    CpuMeter.#start();
  }

  static #send(request: Request): void {
    CpuMeter.#start().postMessage(request);
  }

  static #start(): Worker {
    if (!CpuMeter.#sampler) {
      const sampler = new Worker(new URL(import.meta.url));
      sampler.on('message', (reply: Reply) => {
        CpuMeter.#pending.get(reply.id)?.(reply.shares);
        CpuMeter.#pending.delete(reply.id);
        if (CpuMeter.#pending.size === 0) sampler.unref();
      });
      sampler.unref();
      CpuMeter.#sampler = sampler;
    }
    return CpuMeter.#sampler;
  }
}

interface Window {
  startedAt: number;
  startTotals: { busy: number; all: number };
  before: Map<number, ProcessTimes>;
  /** The last reading of every process seen during the window (one that ended keeps its last). */
  latest: Map<number, ProcessTimes>;
  disk: DiskWaitTally;
}

/** The worker thread: reads /proc while windows are open, and accounts each when it ends. */
function runSampler(port: NonNullable<typeof parentPort>): void {
  const windows = new Map<number, Window>();
  const databases = new Map<number, string>();
  let postmaster: number | undefined;
  let timer: NodeJS.Timeout | undefined;
  let diskTimer: NodeJS.Timeout | undefined;
  let diskLooks = false;
  const sample = () => {
    const now = readProcesses(postmaster, databases);
    for (const window of windows.values()) for (const [pid, times] of now) window.latest.set(pid, times);
  };
  const lookAtDisk = () => {
    const waiting = processesWaitingOnDisk();
    if (waiting === undefined) return;
    diskLooks = true;
    const now = performance.now();
    for (const window of windows.values()) window.disk.add(now, waiting);
  };

  port.on('message', (request: Request) => {
    if (request.kind === 'begin') {
      postmaster = request.postmasterPid;
      const before = readProcesses(postmaster, databases);
      windows.set(request.id, { startedAt: performance.now(), startTotals: readTotals(), before, latest: new Map(before), disk: new DiskWaitTally() });
      timer ??= setInterval(sample, SAMPLE_INTERVAL_MS);
      diskTimer ??= setInterval(lookAtDisk, DISK_LOOK_MS);
      return;
    }
    sample();
    const window = windows.get(request.id)!;
    windows.delete(request.id);
    window.disk.close(performance.now());
    const shares = { ...account(window, request, postmaster), disk: diskLooks ? window.disk.figures() : undefined };
    port.postMessage({ id: request.id, shares } satisfies Reply);
    if (windows.size === 0) {
      clearInterval(timer);
      clearInterval(diskTimer);
      timer = undefined;
      diskTimer = undefined;
    }
  });
}

function account(
  window: Window,
  request: Extract<Request, { kind: 'end' }>,
  postmaster: number | undefined,
): Omit<CpuShares, 'disk'> {
  const totals = readTotals();
  const seconds = (performance.now() - window.startedAt) / 1000;
  const hz = clockTicks();
  const { latest } = window;
  const gateway = descendants(latest, request.gatewayPids);
  const generator = descendants(latest, [request.generatorPid]);
  const used: Record<CpuClass, number> = { generator: 0, gateway: 0, postgres: 0, other: 0 };
  const others = new Map<string, number>();
  for (const [pid, info] of latest) {
    const delta = info.ticks - (window.before.get(pid)?.ticks ?? 0);
    if (delta <= 0) continue;
    let kind: CpuClass = 'other';
    // The gateway's processes, and an embedded Postgres, are children of the generator's
    // process too: they are looked for first.
    if (gateway.has(pid)) kind = 'gateway';
    else if (postmaster !== undefined && (pid === postmaster || info.ppid === postmaster)) {
      kind = !info.database || info.database === request.database ? 'postgres' : 'other';
    } else if (generator.has(pid)) kind = 'generator';
    used[kind] += delta;
    if (kind === 'other') {
      const name = info.database ? `postgres (database ${info.database})` : info.name;
      others.set(name, (others.get(name) ?? 0) + delta);
    }
  }
  const cores = coreCount();
  const ticksPerCore = (totals.all - window.startTotals.all) / cores || 1;
  const busyCores = (totals.busy - window.startTotals.busy) / ticksPerCore;
  const share = Object.fromEntries(
    Object.entries(used).map(([kind, ticks]) => [kind, ticks / hz / seconds]),
  ) as Record<CpuClass, number>;
  // Time of processes that came and went between two readings is only in the machine's
  // total: "other" is at least what the total has beyond the known classes.
  share.other = Math.max(share.other, busyCores - share.generator - share.gateway - share.postgres);
  return {
    seconds,
    others: [...others]
      .map(([name, ticks]) => ({ name, cores: ticks / hz / seconds }))
      .sort((a, b) => b.cores - a.cores)
      .slice(0, 3),
    cores: { ...share, total: busyCores, idle: Math.max(0, cores - busyCores) },
  };
}

function coreCount(): number {
  return readFileSync('/proc/stat', 'latin1').split('\n').filter((line) => /^cpu\d+ /.test(line)).length;
}

/**
 * A backend's process title is "postgres: [cluster: ]user database host state"; background
 * processes (checkpointer, walwriter, autovacuum launcher, ...) name no database ('') and are
 * shared by all, so they count as Postgres. A backend that has not read its startup message yet
 * still has the postmaster's command line for a title, and nothing says which database it will
 * serve: undefined (as for a process that has exited).
 */
function databaseOf(pid: number): string | undefined {
  let title: string;
  try {
    title = readFileSync(`/proc/${pid}/cmdline`, 'latin1').replaceAll('\0', ' ').trim();
  } catch {
    return undefined;
  }
  if (!title.startsWith('postgres: ')) return undefined;
  return /^postgres: (?:\S+: )?\S+ (\S+) (?:\S+\(\d+\)|\[local\]) /.exec(title)?.[1] ?? '';
}

/**
 * Waits until the machine is quiet (less than `maxBusyCores` busy over a second), for at most
 * `timeoutMs`; returns the busy cores of the last second read.
 */
export async function waitForQuiet(maxBusyCores: number, timeoutMs: number): Promise<number> {
  const deadline = performance.now() + timeoutMs;
  for (;;) {
    const before = readTotals();
    await new Promise((resolve) => setTimeout(resolve, 1000));
    const after = readTotals();
    const busy = ((after.busy - before.busy) / (after.all - before.all || 1)) * coreCount();
    if (busy < maxBusyCores || performance.now() > deadline) return busy;
  }
}

export function formatShares(shares: CpuShares): string {
  const c = shares.cores;
  const f = (value: number) => value.toFixed(2);
  return `CPU in cores: gateway ${f(c.gateway)}, postgres ${f(c.postgres)}, load generator ${f(c.generator)}, other ${f(c.other)}, idle ${f(c.idle)}`;
}

if (!isMainThread && parentPort) runSampler(parentPort);
