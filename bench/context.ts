// What every phase is given: the settings, the Postgres server, a fresh database of its own,
// the gateway processes it asks for (stopped and counted for the report when it ends), a
// signer for the test key, and CPU accounting of its measured window.
import path from 'node:path';
import type pg from 'pg';
import { formatDiskWaits } from '../scripts/disk-waits.ts';
import { CpuMeter, formatShares, type CpuShares } from './cpu.ts';
import { GatewayProcess, type Role } from './gateway.ts';
import { summarizeProfiles } from './profile.ts';
import { withClient, type Server } from './postgres.ts';
import type { Settings } from './settings.ts';
import { RequestSigner, type Credentials } from './signing.ts';

export interface Row {
  figure: string;
  result: string;
  target: string;
  /** Whether the target is met; undefined where there is no target. */
  met?: boolean | undefined;
}

export interface PhaseResult {
  rows: Row[];
  /** Lines printed under the table: how it was measured, CPU, spread, anything odd. */
  details: string[];
  /** Machine-readable figures, kept in the results file. */
  data: Record<string, unknown>;
}

export interface RunContext {
  settings: Settings;
  server: Server;
  template: string;
  runId: string;
  runDir: string;
  credentials: Credentials;
  secretEncryptionKey: string;
}

export class PhaseContext {
  readonly run: RunContext;
  readonly name: string;
  readonly database: string;
  readonly databaseUrl: string;
  readonly #gateways: GatewayProcess[] = [];

  constructor(run: RunContext, name: string) {
    this.run = run;
    this.name = name;
    this.database = `${run.runId}_${name.replaceAll('-', '_')}`;
    this.databaseUrl = run.server.urlFor(this.database);
  }

  get settings(): Settings {
    return this.run.settings;
  }

  async open(): Promise<void> {
    await this.run.server.createDatabase(this.database, this.run.template);
  }

  /** Starts gateway processes, API first (so a worker's first jobs find it listening). */
  async start(roles: Role[], settings: Record<string, string> = {}): Promise<GatewayProcess[]> {
    const started: GatewayProcess[] = [];
    const ordered = [...roles.filter((role) => role !== 'worker'), ...roles.filter((role) => role === 'worker')];
    for (const [index, role] of ordered.entries()) {
      const label = `${this.name}-${role}-${this.#gateways.length + index}`;
      const gateway = await GatewayProcess.start(
        role,
        { databaseUrl: this.databaseUrl, secretEncryptionKey: this.run.secretEncryptionKey, settings },
        path.join(this.run.runDir, `${label}.log`),
        this.settings.profile ? path.join(this.run.runDir, 'profiles', label) : undefined,
      );
      this.#gateways.push(gateway);
      started.push(gateway);
    }
    return started;
  }

  /** The process serving the API among those started. */
  api(): GatewayProcess {
    const api = this.#gateways.find((gateway) => gateway.role !== 'worker' && gateway.exitCode === undefined);
    if (!api) throw new Error('no gateway process serves the API');
    return api;
  }

  signer(port: number): RequestSigner {
    return new RequestSigner(this.run.credentials, `127.0.0.1:${port}`);
  }

  query<T>(run: (client: pg.Client) => Promise<T>): Promise<T> {
    return withClient(this.databaseUrl, run);
  }

  /** CPU accounting from now until its end(). */
  cpuMeter(): CpuMeter {
    return new CpuMeter({
      gatewayPids: () => this.#gateways.map((gateway) => gateway.pid),
      postmasterPid: this.run.server.postmasterPid,
      database: () => this.database,
    });
  }

  /**
   * A CPU meter over a load's measured window: give the load its onWindowStart/onWindowEnd,
   * then await shares() (undefined if the window never ended).
   */
  cpuWindow(): { onWindowStart(): void; onWindowEnd(): void; shares(): Promise<CpuShares | undefined> } {
    let meter: CpuMeter | undefined;
    let shares: Promise<CpuShares> | undefined;
    return {
      onWindowStart: () => {
        meter = this.cpuMeter();
      },
      onWindowEnd: () => {
        shares = meter?.end();
      },
      shares: async () => shares,
    };
  }

  /** Requests and graphile-worker jobs in the phase's database. */
  async storedCounts(): Promise<{ requests: number; jobs: number }> {
    return this.query(async (client) => {
      const { rows } = await client.query<{ requests: string; jobs: string }>(
        `select (select count(*) from gateway.requests) as requests, (select count(*) from graphile_worker.jobs) as jobs`,
      );
      return { requests: Number(rows[0]!.requests), jobs: Number(rows[0]!.jobs) };
    });
  }

  /** Stops every gateway process, drops the database, and returns lines for the report. */
  async close(): Promise<string[]> {
    const lines: string[] = [];
    for (const gateway of [...this.#gateways].reverse()) {
      await gateway.stop();
      const { warnings, errors, samples } = gateway.log;
      if (gateway.exitCode !== 0) lines.push(`gateway --role ${gateway.role} exited with ${gateway.exitCode}`);
      if (warnings + errors > 0) {
        lines.push(
          `gateway --role ${gateway.role} logged ${warnings} warnings and ${errors} errors (${path.relative(process.cwd(), gateway.logFile)}): ${samples.join(' | ')}`,
        );
      }
    }
    if (this.settings.profile) lines.push(...summarizeProfiles(path.join(this.run.runDir, 'profiles'), this.name));
    await this.run.server.dropDatabase(this.database);
    return lines;
  }
}

/** A wait on the disk this long marks a window's latencies as the disk's (a flush takes about 0.2 ms here when the disk is well). */
const DISK_STALL_MS = 100;

/**
 * "CPU in cores: ..." with a warning when something outside the benchmark was busy, or the disk
 * stalled; with the rate of requests over the same window, also the CPU each request cost the
 * gateway and Postgres.
 */
export function cpuLine(shares: CpuShares, requestsPerSecond?: number): string {
  let line = formatShares(shares);
  if (requestsPerSecond !== undefined && requestsPerSecond > 0) {
    const micros = (cores: number) => Math.round((cores / requestsPerSecond) * 1e6);
    line += `; per request: gateway ${micros(shares.cores.gateway)} µs, postgres ${micros(shares.cores.postgres)} µs, load generator ${micros(shares.cores.generator)} µs of CPU`;
  }
  if (shares.disk) line += `; ${formatDiskWaits(shares.disk)}`;
  // This machine's own services (a message broker, the VM's agent, ...) take about 0.1 core.
  if (shares.cores.other > 0.25) {
    const who = shares.others.map((other) => `${other.name} ${other.cores.toFixed(2)}`).join(', ');
    return `${line}  ** NOISY: other processes used ${shares.cores.other.toFixed(2)} cores (${who || 'short-lived processes'}); rerun on a quiet machine **`;
  }
  if (shares.disk && shares.disk.longestMs >= DISK_STALL_MS) {
    return `${line}  ** DISK STALL: a process waited ${shares.disk.longestMs} ms on the disk; every commit waits behind such a flush, so this window's latencies include it: rerun **`;
  }
  if (shares.cores.generator > 0.8) return `${line}  ** the load generator is near one full core: it may be the limit **`;
  return line;
}
