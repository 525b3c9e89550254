// What the figures were measured on, and with what: printed above the table.
import { execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import type { ServerDescription } from './postgres.ts';

const ROOT = path.resolve(import.meta.dirname, '..');

export interface Machine {
  cores: number;
  cpu: string;
  memory: string;
  kernel: string;
  node: string;
  loadAverage: number;
  commit: string;
}

export function describeMachine(): Machine {
  return {
    cores: os.availableParallelism(),
    cpu: os.cpus()[0]?.model.trim() ?? 'unknown',
    memory: `${(os.totalmem() / 1024 ** 3).toFixed(1)} GiB`,
    kernel: `${os.type()} ${os.release()}`,
    node: process.version,
    loadAverage: os.loadavg()[0]!,
    commit: commitOfCheckout(),
  };
}

/** The commit measured, and whether the work tree differed from it (outside bench/ and .data/). */
function commitOfCheckout(): string {
  try {
    const commit = execFileSync('git', ['rev-parse', '--short', 'HEAD'], { cwd: ROOT, encoding: 'utf8' }).trim();
    const changed = execFileSync('git', ['status', '--porcelain', '--', '.', ':!bench', ':!BENCHMARKS.md'], {
      cwd: ROOT,
      encoding: 'utf8',
    }).trim();
    return changed ? `${commit} with uncommitted changes` : commit;
  } catch {
    return 'unknown (not a git checkout)';
  }
}

export function machineLines(machine: Machine, postgres: ServerDescription, command: string, busyCores: number): string[] {
  const s = postgres.settings;
  return [
    `machine: ${machine.cores} cores (${machine.cpu}), ${machine.memory} memory, ${machine.kernel}; ` +
      `load generator, gateway and Postgres all on it`,
    `software: Node ${machine.node}; PostgreSQL ${postgres.version} at ${postgres.where} ` +
      `(fsync ${s.fsync}, synchronous_commit ${s.synchronous_commit}, wal_sync_method ${s.wal_sync_method}, ` +
      `shared_buffers ${s.shared_buffers}, max_connections ${s.max_connections}, autovacuum ${s.autovacuum})`,
    `code: ${machine.commit}`,
    `command: ${command}`,
    `before the run: ${busyCores.toFixed(2)} cores busy (over one second), load average ${machine.loadAverage.toFixed(2)}` +
      (busyCores > 0.25 ? '  ** the machine was already busy: figures may be low **' : ''),
  ];
}

/** Names of the settings src/config.ts reads, so gateway settings given to the run are shown. */
export function gatewaySettingNames(): string[] {
  try {
    const source = readFileSync(path.join(ROOT, 'src', 'config.ts'), 'utf8');
    return [...source.matchAll(/^ {2}([A-Z][A-Z0-9_]+):/gm)].map((match) => match[1]!);
  } catch {
    return [];
  }
}
