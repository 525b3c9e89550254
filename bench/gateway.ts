// The gateway under test, as real child processes of this checkout's own command line
// (`node src/cli.ts ...`), so the benchmark measures exactly what would be deployed and never
// reaches into its internals. Each process's output goes to a log file; warnings and errors in
// it are counted and reported with the phase.
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { createWriteStream, readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { promisify } from 'node:util';
import pg from 'pg';
import { descendants } from './cpu.ts';
import { freePort } from '../scripts/ports.ts';
import { BENCH_APPLICATION_NAME } from './postgres.ts';

const ROOT = path.resolve(import.meta.dirname, '..');
const CLI = path.join(ROOT, 'src', 'cli.ts');

export type Role = 'all' | 'api' | 'worker';

export interface GatewayEnv {
  databaseUrl: string;
  secretEncryptionKey: string;
  /** Settings for this phase (WAIT_TIMEOUT_MS, ...); they win over the caller's environment. */
  settings?: Record<string, string>;
}

/**
 * The environment of a gateway process: the benchmark's own environment (so that gateway
 * settings such as WORKER_CONCURRENCY given to `make bench` reach it), then what the benchmark
 * must decide itself.
 */
function environment(env: GatewayEnv, port: number | undefined): NodeJS.ProcessEnv {
  const inherited = Object.fromEntries(Object.entries(process.env).filter(([name]) => !name.startsWith('BENCH_')));
  return {
    ...inherited,
    LOG_LEVEL: 'warn',
    // Test keys never reach the upstream; should anything try, it goes nowhere. A phase with a
    // live key names its own upstream.
    UPSTREAM_BASE_URL: 'http://127.0.0.1:9/v1',
    ...env.settings,
    DATABASE_URL: env.databaseUrl,
    SECRET_ENCRYPTION_KEY: env.secretEncryptionKey,
    // (the process would refuse both keys settings at once)
    SECRET_ENCRYPTION_KEYS: '',
    HOST: '127.0.0.1',
    PORT: String(port ?? 0),
    // Metrics are read from PORT (behind METRICS_TOKEN) by the phases that read them; a
    // METRICS_PORT would take them away, and be one port for several processes.
    METRICS_PORT: '',
  };
}

/** Runs a one-off command of the gateway's CLI (migrate, keys create) and returns its stdout. */
export async function gatewayCommand(env: GatewayEnv, args: string[]): Promise<string> {
  const { stdout } = await promisify(execFile)(process.execPath, [CLI, ...args], {
    cwd: ROOT,
    env: environment(env, undefined),
    maxBuffer: 1024 * 1024,
  });
  return stdout;
}

export interface LogSummary {
  warnings: number;
  errors: number;
  /** A few distinct messages, for the report. */
  samples: string[];
}

/** Every gateway process still running, so that an interrupted benchmark can end them. */
export const running = new Set<GatewayProcess>();

export class GatewayProcess {
  readonly role: Role;
  /** Its HTTP port: the API's, or for a worker its health; and /metrics, when a phase sets METRICS_TOKEN. */
  readonly port: number;
  readonly logFile: string;
  readonly #child: ChildProcess;
  readonly #log: LogSummary = { warnings: 0, errors: 0, samples: [] };
  readonly #exited: Promise<number | null>;
  #exitCode: number | null | undefined;

  private constructor(role: Role, port: number, child: ChildProcess, logFile: string) {
    this.role = role;
    this.port = port;
    this.#child = child;
    this.logFile = logFile;
    running.add(this);
    this.#exited = new Promise((resolve) => {
      child.once('exit', (code, signal) => {
        running.delete(this);
        this.#exitCode = code ?? (signal ? 128 : null);
        resolve(this.#exitCode);
      });
    });
    const file = createWriteStream(logFile, { flags: 'a' });
    let partial = '';
    const onData = (chunk: Buffer) => {
      file.write(chunk);
      const lines = (partial + chunk.toString('utf8')).split('\n');
      partial = lines.pop() ?? '';
      for (const line of lines) this.#count(line);
    };
    child.stdout!.on('data', onData);
    child.stderr!.on('data', onData);
    child.once('exit', () => file.end());
  }

  /** `profileDirectory`: run with --cpu-prof, writing the profile there when the process exits. */
  static async start(role: Role, env: GatewayEnv, logFile: string, profileDirectory?: string): Promise<GatewayProcess> {
    const port = await freePort();
    const profiling = profileDirectory ? ['--cpu-prof', `--cpu-prof-dir=${profileDirectory}`] : [];
    const child = spawn(process.execPath, [...profiling, CLI, 'serve', '--role', role], {
      cwd: ROOT,
      env: environment(env, port),
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    const gateway = new GatewayProcess(role, port, child, logFile);
    try {
      await gateway.#ready(env.databaseUrl);
    } catch (error) {
      await gateway.stop();
      throw error;
    }
    return gateway;
  }

  get pid(): number {
    return this.#child.pid!;
  }

  get exitCode(): number | null | undefined {
    return this.#exitCode;
  }

  get log(): LogSummary {
    return this.#log;
  }

  /** Resident memory of the process and its children, in bytes (VmRSS from /proc). */
  residentBytes(): number {
    let total = 0;
    for (const pid of descendantsOf(this.pid)) total += residentBytesOf(pid);
    return total;
  }

  /** For an interrupted benchmark: no orderly shutdown. */
  kill(): void {
    this.#child.kill('SIGKILL');
  }

  /** SIGTERM (the gateway shuts down in order), then SIGKILL if it has not exited in time. */
  async stop(timeoutMs = 20_000): Promise<void> {
    if (this.#exitCode === undefined) {
      this.#child.kill('SIGTERM');
      const exited = await Promise.race([this.#exited.then(() => true), sleep(timeoutMs, false, { ref: false })]);
      if (!exited) {
        this.#note('error', `did not exit within ${timeoutMs} ms of SIGTERM; killed`);
        this.#child.kill('SIGKILL');
        await this.#exited;
      }
    }
  }

  async #ready(databaseUrl: string): Promise<void> {
    const deadline = Date.now() + 60_000;
    while (Date.now() < deadline) {
      if (this.#exitCode !== undefined) {
        throw new Error(`the gateway (--role ${this.role}) exited with ${this.#exitCode} at start-up; see ${this.logFile}`);
      }
      if (await this.#isReady(databaseUrl)) return;
      await sleep(100);
    }
    throw new Error(`the gateway (--role ${this.role}) was not ready within 60 s; see ${this.logFile}`);
  }

  async #isReady(databaseUrl: string): Promise<boolean> {
    if (this.role !== 'worker') {
      try {
        const response = await fetch(`http://127.0.0.1:${this.port}/readyz`);
        return response.status === 200;
      } catch {
        return false;
      }
    }
    // A worker's health server listens before its job loop starts: it is up once its pool has
    // connected (it names itself in pg_stat_activity) and the process has had a moment more.
    const client = new pg.Client({ connectionString: databaseUrl, application_name: BENCH_APPLICATION_NAME });
    try {
      await client.connect();
      const { rows } = await client.query<{ count: string }>(
        `select count(*) from pg_stat_activity
         where datname = current_database() and application_name like 'gateway-worker%'`,
      );
      if (Number(rows[0]!.count) === 0) return false;
      await sleep(500);
      return true;
    } catch {
      return false;
    } finally {
      await client.end().catch(() => {});
    }
  }

  #count(line: string): void {
    if (line.trim() === '') return;
    let level: string;
    let message: string;
    try {
      const parsed = JSON.parse(line) as { level?: string; msg?: string; err?: { message?: string } };
      level = parsed.level ?? 'info';
      message = [parsed.msg, parsed.err?.message].filter(Boolean).join(': ');
    } catch {
      // Not a log line: something printed to stderr (a crash, a warning of Node's own).
      level = 'error';
      message = line.trim();
    }
    if (level === 'warn' || level === 'error' || level === 'fatal') this.#note(level === 'warn' ? 'warn' : 'error', message);
  }

  #note(level: 'warn' | 'error', message: string): void {
    if (level === 'warn') this.#log.warnings++;
    else this.#log.errors++;
    const sample = `${level}: ${message.slice(0, 160)}`;
    if (this.#log.samples.length < 5 && !this.#log.samples.includes(sample)) this.#log.samples.push(sample);
  }
}

/**
 * Resident memory of one process, in bytes (VmRSS from /proc; 0 once it has exited): one small
 * read, cheap enough to take every 100 ms where the process is known to have no children.
 */
export function residentBytesOf(pid: number): number {
  try {
    const status = readFileSync(`/proc/${pid}/status`, 'latin1');
    return Number(/^VmRSS:\s+(\d+) kB/m.exec(status)?.[1] ?? 0) * 1024;
  } catch {
    return 0; // exited
  }
}

function descendantsOf(pid: number): Set<number> {
  const processes = new Map<number, { ppid: number }>();
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      const stat = readFileSync(`/proc/${entry}/stat`, 'latin1');
      processes.set(Number(entry), { ppid: Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]) });
    } catch {
      // exited
    }
  }
  return descendants(processes, [pid]);
}
