// Real gateway processes (`node src/cli.ts serve --role ...`) for the fault scenarios: started
// with an environment of their own, their stdout and stderr kept line by line in memory and in
// the run's log directory, killed with any signal and started again.
import { spawn, type ChildProcess } from 'node:child_process';
import { appendFileSync } from 'node:fs';
import { setTimeout as sleep } from 'node:timers/promises';
import type { Role } from '../../../src/main.ts';

const CLI = new URL('../../../src/cli.ts', import.meta.url).pathname;
const ROOT = new URL('../../../', import.meta.url).pathname;

export interface Exit {
  code: number | null;
  signal: NodeJS.Signals | null;
  at: number;
}

export interface ProcessOptions {
  /** Name in messages and in the log file's name, e.g. "api" or "worker". */
  label: string;
  role: Role;
  env: Record<string, string>;
  /** Where every line the process writes is appended. */
  logFile: string;
}

export class GatewayProcess {
  readonly label: string;
  readonly role: Role;
  readonly env: Record<string, string>;
  readonly logFile: string;
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
    this.role = options.role;
    this.env = options.env;
    this.logFile = options.logFile;
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

  /** Starts the process (again, if it ran before) and resolves once it logs "gateway started". */
  async start(timeoutMs = 30_000): Promise<void> {
    if (this.running) throw new Error(`${this.label} is already running`);
    this.#starts += 1;
    const child = spawn(process.execPath, [CLI, 'serve', '--role', this.role], {
      cwd: ROOT,
      env: this.env,
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

    const firstLine = this.lines.length;
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
    appendFileSync(this.logFile, `# ${new Date().toISOString()} start ${this.#starts} of ${this.label} (pid ${pid})\n`);
    for (const stream of [child.stdout, child.stderr]) {
      let rest = '';
      stream?.setEncoding('utf8');
      stream?.on('data', (chunk: string) => {
        appendFileSync(this.logFile, chunk);
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
