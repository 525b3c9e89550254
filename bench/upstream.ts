// The slow-upstream phase's loopback upstream (bench/slow-upstream.ts) as a child process: started
// and asked for its counts over an IPC channel, its output in a log file. Should the benchmark end
// without stopping it, the channel closes with the benchmark's process and the upstream exits.
import { spawn, type ChildProcess } from 'node:child_process';
import { createWriteStream } from 'node:fs';
import path from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import type { UpstreamMessage, UpstreamStats } from './slow-upstream.ts';

const SCRIPT = path.join(import.meta.dirname, 'slow-upstream.ts');
const START_TIMEOUT_MS = 10_000;

export class SlowUpstream {
  readonly port: number;
  readonly #child: ChildProcess;
  readonly #exited: Promise<void>;
  /** Callers of stats() waiting for the next answer. */
  #waiting: PromiseWithResolvers<UpstreamStats>[] = [];

  private constructor(child: ChildProcess, port: number) {
    this.#child = child;
    this.port = port;
    this.#exited = new Promise((resolve) => {
      child.once('exit', (code, signal) => {
        for (const waiting of this.#take()) waiting.reject(new Error(`the slow upstream exited (${signal ?? code})`));
        resolve();
      });
    });
    child.on('message', (message: UpstreamMessage) => {
      if (message.kind === 'stats') for (const waiting of this.#take()) waiting.resolve(message.stats);
    });
  }

  /** Starts the upstream, answering after `delayMs`, and resolves once it listens. */
  static async start(delayMs: number, logFile: string): Promise<SlowUpstream> {
    const child = spawn(process.execPath, [SCRIPT, String(delayMs)], { stdio: ['ignore', 'pipe', 'pipe', 'ipc'] });
    const log = createWriteStream(logFile, { flags: 'a' });
    child.stdout!.pipe(log);
    child.stderr!.pipe(log);
    const port = await new Promise<number>((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`the slow upstream did not listen within ${START_TIMEOUT_MS} ms; see ${logFile}`)), START_TIMEOUT_MS);
      child.once('exit', (code) => reject(new Error(`the slow upstream exited with ${code} at start-up; see ${logFile}`)));
      child.on('message', (message: UpstreamMessage) => {
        if (message.kind !== 'listening') return;
        clearTimeout(timer);
        resolve(message.port);
      });
    }).catch((error: unknown) => {
      child.kill('SIGKILL');
      throw error;
    });
    return new SlowUpstream(child, port);
  }

  /** What the gateway's UPSTREAM_BASE_URL is set to. */
  get baseUrl(): string {
    return `http://127.0.0.1:${this.port}/v1`;
  }

  /** Its counts now. */
  stats(): Promise<UpstreamStats> {
    if (this.#child.exitCode !== null || !this.#child.connected) return Promise.reject(new Error('the slow upstream has exited'));
    const waiting = Promise.withResolvers<UpstreamStats>();
    this.#waiting.push(waiting);
    this.#child.send({ kind: 'stats' });
    return waiting.promise;
  }

  #take(): PromiseWithResolvers<UpstreamStats>[] {
    const waiting = this.#waiting;
    this.#waiting = [];
    return waiting;
  }

  /** Closes the channel (the upstream exits), then SIGKILL if it has not exited within 5 s. */
  async stop(): Promise<void> {
    if (this.#child.exitCode !== null || this.#child.signalCode !== null) return;
    if (this.#child.connected) this.#child.disconnect();
    const exited = await Promise.race([this.#exited.then(() => true), sleep(5_000, false, { ref: false })]);
    if (!exited) {
      this.#child.kill('SIGKILL');
      await this.#exited;
    }
  }
}
