// What the outage scenarios (provider outages, deployments and deadlines) share: a gateway with
// the default retry settings in front of loopback upstreams listed in an UPSTREAMS_FILE, requests
// sent at an even pace, the lanes' health read from gateway.lane_states while things happen,
// requests read with their attempts (upstream, charged), the rules a request's rows must keep
// (lifecycle and charging), the 'lane health changed' log lines, and the outage itself: a fake
// upstream switched between healthy and one way of failing.
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import type pg from 'pg';
import type { RequestWithAttempts as OutageRequest } from '../faults/support/rows.ts';
import type { CreatedKey } from '../../src/keys/service.ts';
import { call, type Call } from '../faults/support/client.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import type { Teardown } from '../helpers/teardown.ts';
import { completionAfter, errorFor, type FakeUpstream, type ReceivedCall, type Script } from '../helpers/upstream.ts';

export const MODEL = 'gpt-4o';
export const MAX_ATTEMPTS = 5;

/** The retry settings a deployment runs with (TEST_SETTINGS' fast retries would hide what charging does). */
export const DEFAULT_RETRIES: Record<string, string> = {
  RETRY_BASE_MS: '1000',
  RETRY_MAX_MS: '60000',
  MAX_ATTEMPTS: String(MAX_ATTEMPTS),
};

export interface UpstreamEntry {
  name: string;
  base_url: string;
  /** Public names, or `{public: upstream's own}` renames. */
  models: (string | Record<string, string>)[];
}

/** Writes `{"upstreams": [...]}` to a file of its own, removed at teardown; returns its path. */
export async function writeUpstreamsFile(t: Teardown, upstreams: UpstreamEntry[]): Promise<string> {
  const directory = await mkdtemp(path.join(tmpdir(), 'gateway-outages-'));
  t.teardown(() => rm(directory, { recursive: true, force: true }));
  const file = path.join(directory, 'upstreams.json');
  await writeFile(file, JSON.stringify({ upstreams }));
  return file;
}

/** A gateway (API and worker in this process) serving these upstreams, with the default retries. */
export async function startOutageGateway(
  t: Teardown,
  upstreams: UpstreamEntry[],
  env: Record<string, string> = {},
): Promise<TestGateway> {
  const file = await writeUpstreamsFile(t, upstreams);
  return startTestGateway(t, { env: { ...DEFAULT_RETRIES, UPSTREAMS_FILE: file, ...env } });
}

/** How long a healthy upstream takes to answer a call in these scenarios (ms). */
export const LATENCY_MS = 200;

/**
 * A provider's outage as the gateway sees it: answering one status (503, 401, ...), hanging (no
 * answer: the gateway's upstream timeout ends the call), or refusing connections (its port closed).
 */
export type OutageMode = { kind: 'healthy' } | { kind: 'status'; status: number } | { kind: 'hang' } | { kind: 'refuse' };

/** How the upstream answers a call in this mode; a healthy one after `latencyMs`. */
export function outageReply(mode: OutageMode, latencyMs = LATENCY_MS): Script {
  switch (mode.kind) {
    case 'healthy':
      return completionAfter(latencyMs);
    case 'status':
      return () => ({ status: mode.status, json: errorFor(mode.status) });
    case 'hang':
      return () => ({ hang: true });
    case 'refuse':
      // A call on a connection opened just before the port closed.
      return () => ({ reset: true });
  }
}

/**
 * Switches what the upstream's calls meet from now on: a call keeps what it met when it arrived.
 * 'refuse' closes its port (dropping every connection); any other mode listens again.
 */
export async function setOutage(upstream: FakeUpstream, mode: OutageMode, latencyMs = LATENCY_MS): Promise<void> {
  upstream.replyWith(outageReply(mode, latencyMs));
  if (mode.kind === 'refuse') await upstream.refuseConnections();
  else await upstream.acceptConnections();
}

/** Calls that arrived in [from, to) and were not answered 200 (answered an error, hung, or cut). */
export function failedCallsBetween(calls: readonly ReceivedCall[], from: number, to: number): ReceivedCall[] {
  return calls.filter((call) => call.arrivedAt >= from && call.arrivedAt < to && call.status !== 200);
}

/** The most calls under way at once among these (a call still open counts until `now`). */
export function peakOverlap(calls: readonly ReceivedCall[], now = Date.now()): number {
  const edges = calls.flatMap((call) => [
    { at: call.arrivedAt, step: 1 },
    { at: call.endedAt ?? now, step: -1 },
  ]);
  // An end and a start at the same millisecond do not overlap.
  edges.sort((a, b) => a.at - b.at || a.step - b.step);
  let current = 0;
  let peak = 0;
  for (const edge of edges) {
    current += edge.step;
    peak = Math.max(peak, current);
  }
  return peak;
}

/**
 * Sends `count` requests (wait false) at an even pace over `overMs`, each signed, and resolves
 * with every answer once all are in; `content(i)` is the i-th request's message.
 */
export async function sendSpread(
  url: string,
  key: CreatedKey,
  options: { count: number; overMs: number; content: (i: number) => string; model?: string; onSent?: (i: number) => void },
): Promise<Call[]> {
  const startedAt = Date.now();
  const sent: Promise<Call>[] = [];
  for (let i = 0; i < options.count; i++) {
    const due = startedAt + (i * options.overMs) / options.count;
    if (due > Date.now()) await sleep(due - Date.now());
    sent.push(post(url, key, options.content(i), options.model));
    options.onSent?.(i);
  }
  return Promise.all(sent);
}

/** One request, wait false. */
export function post(url: string, key: CreatedKey, content: string, model = MODEL): Promise<Call> {
  return call(url, {
    path: '/v1/chat/completions',
    key,
    body: { model, messages: [{ role: 'user', content }], wait: false },
  });
}

export interface LaneRead {
  /** Date.now() of the read. */
  at: number;
  upstream: string;
  health: string;
  health_since: Date | null;
  last_error: string | null;
  last_error_at: Date | null;
  next_probe_at: Date | null;
  waiting: number;
  running: number;
}

/** The lane of `upstream` and `model` (live mode) as gateway.lane_states shows it; undefined before its first request. */
export async function laneState(pool: pg.Pool, upstream: string, model = MODEL): Promise<LaneRead | undefined> {
  const { rows } = await pool.query<Omit<LaneRead, 'at'>>(
    `select upstream, health, health_since, last_error, last_error_at, next_probe_at, waiting::int, running::int
     from gateway.lane_states where mode = 'live' and upstream = $1 and model = $2`,
    [upstream, model],
  );
  return rows[0] && { at: Date.now(), ...rows[0] };
}

export interface LaneWatch {
  reads: LaneRead[];
  /** Stops reading; throws what a read threw, if one did. */
  stop(): Promise<LaneRead[]>;
}

/** Reads the lane every `everyMs` until stopped: its health at every read. */
export function watchLane(pool: pg.Pool, upstream: string, model = MODEL, everyMs = 250): LaneWatch {
  const reads: LaneRead[] = [];
  let stopped = false;
  let failure: unknown;
  const loop = (async () => {
    while (!stopped) {
      try {
        const read = await laneState(pool, upstream, model);
        if (read) reads.push(read);
      } catch (error) {
        failure = error;
        return;
      }
      await sleep(everyMs);
    }
  })();
  return {
    reads,
    async stop() {
      stopped = true;
      await loop;
      if (failure) throw failure;
      return reads;
    },
  };
}

/** The healths a lane of a listed upstream may show. */
export const HEALTHS = ['healthy', 'open', 'probing'];

/** The reads' healths in order, repeats run together ("healthy ×7 → open ×40 → probing"), for t.comment. */
export function readsPath(reads: readonly LaneRead[]): string {
  const runs: { health: string; times: number }[] = [];
  for (const read of reads) {
    const last = runs.at(-1);
    if (last?.health === read.health) last.times++;
    else runs.push({ health: read.health, times: 1 });
  }
  return runs.map((run) => (run.times > 1 ? `${run.health} ×${run.times}` : run.health)).join(' → ') || 'no reads';
}

/** When the lane first opened, as lane_states said (the earliest health_since of a read that was not healthy). */
export function firstOpenedAt(reads: readonly LaneRead[]): number | undefined {
  const since = reads
    .filter((read) => read.health === 'open' || read.health === 'probing')
    .map((read) => read.health_since?.getTime() ?? read.at);
  return since.length === 0 ? undefined : Math.min(...since);
}

export { requestsWithAttempts } from '../faults/support/rows.ts';
export type { AttemptRow as OutageAttempt, RequestWithAttempts as OutageRequest } from '../faults/support/rows.ts';

/**
 * How a terminal request's rows break the lifecycle and charging rules: attempts counts every
 * attempt (each a row, numbered, none running, none after the end), only charged_attempts is
 * bounded by MAX_ATTEMPTS and it counts the rows marked charged, one success per completion.
 */
export function lifecycleProblems(request: OutageRequest, maxAttempts = MAX_ATTEMPTS): string[] {
  const problems: string[] = [];
  const attempts = request.attempt_rows;
  if (request.status !== 'completed' && request.status !== 'failed') problems.push(`status ${request.status}, not terminal`);
  if (request.charged_attempts > maxAttempts) problems.push(`${request.charged_attempts} charged attempts, more than MAX_ATTEMPTS ${maxAttempts}`);
  if (attempts.length !== request.attempts) problems.push(`attempts ${request.attempts} but ${attempts.length} attempt rows`);
  const charged = attempts.filter((attempt) => attempt.charged === true).length;
  if (charged !== request.charged_attempts) problems.push(`charged_attempts ${request.charged_attempts} but ${charged} attempt rows charged`);
  attempts.forEach((attempt, index) => {
    if (attempt.attempt_number !== index + 1) problems.push(`attempt rows numbered ${attempts.map((a) => a.attempt_number).join(',')}`);
    if (attempt.outcome === 'running') problems.push(`attempt ${attempt.attempt_number} still running`);
    if (attempt.upstream === null) problems.push(`attempt ${attempt.attempt_number} names no upstream`);
    if (request.finished_at && attempt.started_at > request.finished_at) {
      problems.push(`attempt ${attempt.attempt_number} started after the request finished`);
    }
  });
  const succeeded = attempts.filter((attempt) => attempt.outcome === 'succeeded').length;
  if (request.status === 'completed' && (succeeded !== 1 || attempts.at(-1)?.outcome !== 'succeeded')) {
    problems.push(`completed with ${succeeded} succeeded attempts, the last ${attempts.at(-1)?.outcome}`);
  }
  if (request.status === 'failed' && succeeded !== 0) problems.push(`failed with ${succeeded} succeeded attempts`);
  if (request.last_error_code !== 'deadline_exceeded') {
    const lastFailure = attempts.filter((attempt) => attempt.outcome === 'failed').at(-1);
    if ((lastFailure?.error_code ?? null) !== request.last_error_code) {
      problems.push(`last_error_code ${request.last_error_code}, but the last failed attempt says ${lastFailure?.error_code ?? null}`);
    }
  }
  return problems;
}

export interface HealthChange {
  time: number;
  upstream: string;
  model: string;
  from: string;
  to: string;
  reason: string;
}

/** The 'lane health changed' lines among these log lines (JSON text), in order. */
export function healthChanges(lines: readonly string[]): HealthChange[] {
  return lines.flatMap((line) => {
    if (!line.includes('lane health changed')) return [];
    try {
      const entry = JSON.parse(line) as Record<string, any>;
      if (entry.msg !== 'lane health changed') return [];
      return [{ time: Number(entry.time), upstream: entry.upstream, model: entry.model, from: entry.from, to: entry.to, reason: String(entry.reason) }];
    } catch {
      return [];
    }
  });
}

/** Each kind of change ("from→to") with how often it happened, in order of first appearance, for t.comment. */
export function healthPath(changes: readonly HealthChange[]): string {
  const counts = new Map<string, number>();
  for (const change of changes) counts.set(`${change.from}→${change.to}`, (counts.get(`${change.from}→${change.to}`) ?? 0) + 1);
  return [...counts].map(([step, times]) => (times > 1 ? `${step} ×${times}` : step)).join(', ') || 'none';
}

/** Seconds, with one decimal, for t.comment. */
export const seconds = (ms: number) => `${(ms / 1000).toFixed(1)} s`;
