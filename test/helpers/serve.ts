// `gateway serve` (or `start`) as a child process of the test (`node src/cli.ts serve`): started with an
// environment of its own, its stdout and stderr kept line by line in memory (and in a log file,
// when given one), sent any signal, and started again.
import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { appendFileSync } from 'node:fs';
import { setTimeout as sleep } from 'node:timers/promises';
import type { Config } from '../../src/config.ts';
import { createTestDatabase } from './database.ts';
import { childEnv, childExecArgv } from './node-child.ts';
import type { Teardown } from './teardown.ts';

const CLI = new URL('../../src/cli.ts', import.meta.url).pathname;
const ROOT = new URL('../../', import.meta.url).pathname;

/**
 * Starts `gateway serve` (with `args`, e.g. ['--role', 'worker']) with these settings over the
 * test's own environment, and `nodeArgs` for node itself after the test's own (both less tap's
 * hooks: node-child.ts); killed at teardown.
 */
export function spawnServe(t: Teardown, env: Record<string, string>, args: string[] = [], nodeArgs: string[] = []): GatewayProcess {
  const gateway = new GatewayProcess({
    label: ['serve', ...args].join(' '),
    args,
    env: { ...childEnv(), ...env },
    nodeArgs: [...childExecArgv(), ...nodeArgs],
  });
  gateway.spawn();
  t.teardown(() => gateway.destroy());
  return gateway;
}

/**
 * An API process (`serve --role api`) on a test database of its own, listening on a port of its
 * choosing on loopback, with `env` over those settings; not started yet, killed at teardown.
 */
export async function apiProcess(t: Teardown, env: Record<string, string> = {}): Promise<GatewayProcess> {
  const api = new GatewayProcess({
    label: 'api',
    args: ['--role', 'api'],
    env: {
      ...childEnv(),
      DATABASE_URL: await createTestDatabase(t),
      SECRET_ENCRYPTION_KEY: randomBytes(32).toString('base64'),
      PORT: '0',
      HOST: '127.0.0.1',
      LOG_LEVEL: 'info',
      ...env,
    },
    nodeArgs: childExecArgv(),
  });
  t.teardown(() => api.destroy());
  return api;
}

export interface Exit {
  code: number | null;
  signal: NodeJS.Signals | null;
  at: number;
}

export interface ProcessOptions {
  /** Its name in messages, e.g. "api" or "worker-a". */
  label: string;
  /** The command run: `gateway serve` unless given (`start`: on the embedded Postgres when DATABASE_URL is unset). */
  command?: 'serve' | 'start';
  /** The command's arguments, e.g. ['--role', 'worker'] (none: every role in one process). */
  args: string[];
  /** Its whole environment. */
  env: Record<string, string>;
  /** Node's own arguments, e.g. ['--expose-gc']. */
  nodeArgs?: string[];
  /** Where every line the process writes is appended, if anywhere. */
  logFile?: string;
}

export class GatewayProcess {
  readonly label: string;
  readonly #options: ProcessOptions;
  /** Every line written, on either stream, across every start. */
  readonly lines: string[] = [];
  /** How each run of the process ended, in order. */
  readonly exits: Exit[] = [];
  /** Base URL of the API, once started (undefined for workers). */
  url: string | undefined;
  #child: ChildProcess | undefined;
  #exited: Promise<Exit> | undefined;
  #starts = 0;

  constructor(options: ProcessOptions) {
    this.label = options.label;
    this.#options = options;
  }

  get pid(): number | undefined {
    return this.running ? this.#child?.pid : undefined;
  }

  get running(): boolean {
    return this.#child !== undefined && this.#child.exitCode === null && this.#child.signalCode === null;
  }

  get starts(): number {
    return this.#starts;
  }

  /** Everything it has written so far, on either stream, across every start. */
  readonly output = (): string => this.lines.join('\n');

  /** Starts the process (again, if it ran before), without waiting for it to be ready. */
  spawn(): void {
    if (this.running) throw new Error(`${this.label} is already running`);
    this.#starts += 1;
    const command = this.#options.command ?? 'serve';
    const child = spawn(process.execPath, [...(this.#options.nodeArgs ?? []), CLI, command, ...this.#options.args], {
      cwd: ROOT,
      env: this.#options.env,
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    this.#child = child;
    this.#exited = new Promise((resolve) => {
      child.once('exit', (code, signal) => {
        const exit = { code, signal, at: Date.now() };
        this.exits.push(exit);
        resolve(exit);
      });
    });
    this.#capture(child);
  }

  /** Starts the process (again, if it ran before) and resolves once it logs "gateway started". */
  async start(timeoutMs = 30_000): Promise<void> {
    const firstLine = this.lines.length;
    this.spawn();
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      for (const line of this.lines.slice(firstLine)) {
        const entry = parseLine(line);
        if (entry?.msg === 'gateway started') {
          this.url = typeof entry.url === 'string' ? entry.url : undefined;
          return;
        }
      }
      if (!this.running) {
        throw new Error(`${this.label} exited before it started:\n${this.lines.slice(firstLine).slice(-20).join('\n')}`);
      }
      if (Date.now() > deadline) {
        await this.kill('SIGKILL');
        throw new Error(`${this.label} did not start within ${timeoutMs} ms:\n${this.lines.slice(firstLine).slice(-20).join('\n')}`);
      }
      await sleep(20);
    }
  }

  /** Sends the signal, if it is running, and returns at once: for a signal it handles and lives on (SIGUSR2). */
  signal(signal: NodeJS.Signals): void {
    if (this.running) this.#child!.kill(signal);
  }

  /** Resolves when the process (started) has exited, on its own or not. */
  exited(): Promise<Exit> {
    if (!this.#exited) throw new Error(`${this.label} was never started`);
    return this.#exited;
  }

  /** Sends the signal and resolves when the process has exited. */
  async kill(signal: NodeJS.Signals): Promise<Exit | undefined> {
    if (!this.#child || !this.#exited) return undefined;
    if (this.running) this.#child.kill(signal);
    return this.#exited;
  }

  /** SIGTERM, and SIGKILL if it has not exited after `graceMs`. */
  async stop(graceMs = 15_000): Promise<Exit | undefined> {
    if (!this.running) return this.exits.at(-1);
    const timer = setTimeout(() => this.#child?.kill('SIGKILL'), graceMs);
    try {
      return await this.kill('SIGTERM');
    } finally {
      clearTimeout(timer);
    }
  }

  /** SIGKILL unless it has already exited: the teardown of every scenario. */
  async destroy(): Promise<void> {
    await this.kill('SIGKILL');
  }

  /** The JSON log entries written so far (lines that are not JSON are left out). */
  entries(): Record<string, unknown>[] {
    return this.lines.flatMap((line) => {
      const entry = parseLine(line);
      return entry ? [entry] : [];
    });
  }

  #capture(child: ChildProcess): void {
    const pid = child.pid;
    const logFile = this.#options.logFile;
    if (logFile) appendToLog(logFile, `# ${new Date().toISOString()} start ${this.#starts} of ${this.label} (pid ${pid})\n`);
    for (const stream of [child.stdout, child.stderr]) {
      let rest = '';
      stream?.setEncoding('utf8');
      stream?.on('data', (chunk: string) => {
        if (logFile) appendToLog(logFile, chunk);
        const parts = (rest + chunk).split('\n');
        rest = parts.pop() ?? '';
        this.lines.push(...parts.filter(Boolean));
      });
      stream?.on('end', () => {
        if (rest) this.lines.push(rest);
        rest = '';
      });
    }
  }
}

export function parseLine(line: string): Record<string, unknown> | undefined {
  if (!line.startsWith('{')) return undefined;
  try {
    return JSON.parse(line) as Record<string, unknown>;
  } catch {
    return undefined;
  }
}

/**
 * The settings of a `gateway serve` child that shares a test gateway's database and encryption
 * key, listening on `port` on loopback; `settings` add to them or override them.
 */
export function serveSettings(
  gateway: { databaseUrl: string; config: Pick<Config, 'secretEncryptionKeys'> },
  port: number,
  settings: Record<string, string> = {},
): Record<string, string> {
  return {
    DATABASE_URL: gateway.databaseUrl,
    SECRET_ENCRYPTION_KEY: gateway.config.secretEncryptionKeys[0]!.toString('base64'),
    PORT: String(port),
    HOST: '127.0.0.1',
    ...settings,
  };
}

/**
 * Appends to a log file, or lets the text go if the file's directory is gone: a fault scenario's
 * run directory is removed once every scenario's logs were searched (faults/support/run.ts), and
 * what a process says as it is stopped after that is read by nobody.
 */
export function appendToLog(file: string, text: string | Buffer): void {
  try {
    appendFileSync(file, text);
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code !== 'ENOENT') throw error;
  }
}
