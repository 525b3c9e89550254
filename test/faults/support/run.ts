// What the fault suite's files share across one `npm test` run. Each scenario file runs in a
// process of its own, so this lives on disk, in a directory named after the run's template
// database (scripts/test.ts makes one per run): the log of every process a scenario starts,
// and every secret and message content it used, so that the last scenario can search all the
// logs of the run for all of them.
import { appendFileSync, existsSync, mkdirSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { randomBase62 } from '../../../src/ids.ts';

/** Sent upstream by every process of the suite (UPSTREAM_API_KEY); it must never be logged. */
export const UPSTREAM_API_KEY = 'sk-faults-upstream-key-9c4f1e27b83d';

/** Every message content the suite sends contains this, so a leak into a log is easy to find. */
export const CONTENT_MARKER = 'faults-private-content';

export type SecretKind = 'api_key' | 'signing_secret' | 'upstream_api_key' | 'content' | 'webhook_secret';

export interface RecordedSecret {
  kind: SecretKind;
  value: string;
  scenario: string;
}

/** The scenario files; the run's directory is deleted once each has found its logs clean. */
export const SCENARIOS = [
  '1-worker-killed',
  '1-all-killed',
  '2-api-killed',
  '3-postgres-outage',
  '4-chaos-upstream',
  '5-hostile-input',
  '6-isolation-and-logs',
  '7-webhook-receiver-down',
  '8-noisy-neighbour',
  '9-kills-amid-races',
] as const;

const PREFIX = 'gateway-faults-';
const STALE_MS = 24 * 60 * 60 * 1000;

export function runDirectory(): string {
  const run = process.env.GATEWAY_TEST_TEMPLATE ?? `standalone-${process.pid}`;
  const directory = path.join(os.tmpdir(), `${PREFIX}${run}`);
  if (!existsSync(directory)) {
    removeStaleRunDirectories();
    mkdirSync(directory, { recursive: true });
  }
  return directory;
}

/** Directories of runs that ended a day ago or more and were kept (a leak, a partial run). */
function removeStaleRunDirectories(): void {
  for (const name of readdirSync(os.tmpdir())) {
    if (!name.startsWith(PREFIX)) continue;
    const directory = path.join(os.tmpdir(), name);
    try {
      if (Date.now() - statSync(directory).mtimeMs > STALE_MS) rmSync(directory, { recursive: true, force: true });
    } catch {}
  }
}

/** A recognisable message content: `faults-private-content <label> <random>`. */
export function privateContent(label: string): string {
  return `${CONTENT_MARKER} ${label} ${randomBase62(10)}`;
}

export function recordSecret(scenario: string, kind: SecretKind, value: string): void {
  appendFileSync(path.join(runDirectory(), 'secrets.jsonl'), `${JSON.stringify({ kind, value, scenario })}\n`);
}

export function recordedSecrets(): RecordedSecret[] {
  const file = path.join(runDirectory(), 'secrets.jsonl');
  if (!existsSync(file)) return [];
  // Scenarios run side by side and append as they go: a last line without its newline is one
  // still being written (its secret is searched for by its own scenario, which wrote it).
  const lines = readFileSync(file, 'utf8').split('\n');
  return lines
    .slice(0, -1)
    .filter(Boolean)
    .map((line) => JSON.parse(line) as RecordedSecret);
}

/** Where a process's log is kept: `<scenario>.<label>.log` in the run directory. */
export function logFile(scenario: string, label: string): string {
  return path.join(runDirectory(), `${scenario}.${label}.log`);
}

export function logFiles(): string[] {
  return readdirSync(runDirectory())
    .filter((name) => name.endsWith('.log'))
    .sort()
    .map((name) => path.join(runDirectory(), name));
}

/** Notes that a scenario passed and its logs were found clean; once all have, the directory goes. */
export function markLogsClean(scenario: string): void {
  writeFileSync(path.join(runDirectory(), `${scenario}.clean`), '');
  if (SCENARIOS.every((name) => existsSync(path.join(runDirectory(), `${name}.clean`)))) {
    rmSync(runDirectory(), { recursive: true, force: true });
  }
}
