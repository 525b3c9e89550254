// The scenario that 503.test.ts, connection-refused.test.ts, hang.test.ts and auth-refused.test.ts
// each run with an outage of their own: one upstream serving the model fails for 120 s (unless
// told otherwise) while 500 requests arrive, spread over the outage, then recovers. None may fail, all must complete within 30 s of the
// recovery, and the failed calls the gateway made during the outage must average at most 2 a
// second (its lane open: one probe at a time, at growing intervals, none of them charged).
import { setTimeout as sleep } from 'node:timers/promises';
import type { Test } from 'tap';
import { call, spread, tally } from '../faults/support/client.ts';
import { queueSummary, waitUntilTerminal } from '../faults/support/rows.ts';
import type { TestGateway } from '../helpers/gateway.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { startFakeUpstream, type FakeUpstream } from '../helpers/upstream.ts';
import {
  failedCallsBetween,
  firstOpenedAt,
  healthChanges,
  healthPath,
  HEALTHS,
  readsPath,
  laneState,
  lifecycleProblems,
  MODEL,
  outageReply,
  peakOverlap,
  requestsWithAttempts,
  seconds,
  sendSpread,
  setOutage,
  startOutageGateway,
  watchLane,
  type HealthChange,
  type LaneRead,
  type OutageMode,
  type OutageRequest,
} from './support.ts';

export const REQUESTS = 500;
export const OUTAGE_MS = 120_000;
export const RECOVERY_BOUND_MS = 30_000;
export const MAX_FAILED_CALLS_PER_SECOND = 2;

export interface OutageScenario {
  /** Names the scenario's requests and comments, e.g. '503'. */
  label: string;
  outage: OutageMode;
  env?: Record<string, string>;
  /** false when the upstream cannot see the failed calls (a refused connection never reaches it). */
  countedAtUpstream: boolean;
  /** Requests sent, evenly over the outage; default 500. */
  requests?: number;
  /** How long the upstream fails; default 120 s. */
  outageMs?: number;
}

export interface OutageOutcome {
  gateway: TestGateway;
  upstream: FakeUpstream;
  requests: OutageRequest[];
  downAt: number;
  upAt: number;
  openedAt: number | undefined;
  reads: LaneRead[];
  changes: HealthChange[];
}

export async function runSingleUpstreamOutage(t: Test, scenario: OutageScenario): Promise<OutageOutcome> {
  const count = scenario.requests ?? REQUESTS;
  const outageMs = scenario.outageMs ?? OUTAGE_MS;
  const upstream = await startFakeUpstream(t, outageReply({ kind: 'healthy' }));
  const gateway = await startOutageGateway(t, [{ name: 'primary', base_url: upstream.baseUrl, models: [MODEL] }], {
    METRICS_PORT: '0',
    ...scenario.env,
  });
  const key = await gateway.createKey({ project: 'outages', mode: 'live' });

  const warmUp = await call(gateway.url, {
    path: '/v1/chat/completions',
    key,
    body: { model: MODEL, messages: [{ role: 'user', content: `${scenario.label} warm-up` }], wait: true },
  });
  t.equal(warmUp.status, 200, 'before the outage, a request completes on the upstream');

  const watch = watchLane(gateway.pool, 'primary');
  await setOutage(upstream, scenario.outage);
  const downAt = Date.now();
  const accepted = await sendSpread(gateway.url, key, {
    count,
    overMs: outageMs,
    content: (i) => `outage ${scenario.label} request ${i}`,
  });
  if (downAt + outageMs > Date.now()) await sleep(downAt + outageMs - Date.now());
  await setOutage(upstream, { kind: 'healthy' });
  const upAt = Date.now();
  t.equal(tally(accepted.map((answer) => answer.status)), `202: ${count}`, `all ${count} acknowledged during the outage`);
  const ids = accepted.map((answer) => answer.body?.id as string);

  const ended = await waitUntilTerminal(gateway.pool, ids, RECOVERY_BOUND_MS + 30_000);
  const reads = await watch.stop();
  t.ok(ended.done, `all ended (left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);
  if (!ended.done) t.comment(await queueSummary(gateway.pool));
  const requests = await requestsWithAttempts(gateway.pool, ids);

  t.equal(requests.filter((request) => request.status === 'failed').length, 0, 'none failed');
  t.equal(tally(requests.map((request) => request.status)), `completed: ${count}`, 'all completed');
  const problems = requests.flatMap((request) => lifecycleProblems(request).map((problem) => `${request.id}: ${problem}`));
  t.same(problems.slice(0, 20), [], `every request's rows keep the lifecycle and charging rules (${problems.length} problems)`);

  const finishedAfterRecovery = requests.map((request) => (request.finished_at?.getTime() ?? Date.now()) - upAt);
  const lastFinished = Math.max(...finishedAfterRecovery);
  t.ok(lastFinished <= RECOVERY_BOUND_MS, `all completed within ${seconds(RECOVERY_BOUND_MS)} of the recovery (the last ${seconds(lastFinished)} after it)`);

  const openedAt = firstOpenedAt(reads);
  t.ok(openedAt !== undefined, 'the lane opened during the outage (gateway.lane_states)');
  t.same(
    [...new Set(reads.filter((read) => !HEALTHS.includes(read.health)).map((read) => read.health))],
    [],
    `lane_states showed only ${HEALTHS.join(', ')} for the lane, the file listing its upstream throughout`,
  );
  const after = await laneState(gateway.pool, 'primary');
  t.equal(after?.health, 'healthy', 'and is healthy again after it');

  // Failed calls during the outage: as the gateway recorded them, and (when it can see them) as
  // the upstream did.
  const { rows: [attemptCount] } = await gateway.pool.query<{ failed: number }>(
    `select count(*)::int as failed from gateway.request_attempts
     where outcome = 'failed' and started_at >= to_timestamp($1 / 1000.0) and started_at < to_timestamp($2 / 1000.0)`,
    [downAt, upAt],
  );
  const outageSeconds = (upAt - downAt) / 1000;
  const failedAttempts = attemptCount!.failed;
  t.ok(
    failedAttempts / outageSeconds <= MAX_FAILED_CALLS_PER_SECOND,
    `failed attempts during the outage average at most ${MAX_FAILED_CALLS_PER_SECOND} a second (${failedAttempts} in ${outageSeconds.toFixed(0)} s: ${(failedAttempts / outageSeconds).toFixed(2)}/s)`,
  );
  let probeGaps: number[] = [];
  if (scenario.countedAtUpstream) {
    const failedCalls = failedCallsBetween(upstream.calls, downAt, upAt);
    t.ok(
      failedCalls.length / outageSeconds <= MAX_FAILED_CALLS_PER_SECOND,
      `failed calls at the upstream during the outage average at most ${MAX_FAILED_CALLS_PER_SECOND} a second (${failedCalls.length} in ${outageSeconds.toFixed(0)} s: ${(failedCalls.length / outageSeconds).toFixed(2)}/s)`,
    );
    if (openedAt !== undefined) {
      const whileOpen = upstream.calls.filter((c) => c.arrivedAt >= openedAt + 500 && c.arrivedAt < upAt);
      t.ok(peakOverlap(whileOpen) <= 1, `while the lane was open, one call at a time (peak ${peakOverlap(whileOpen)} of ${whileOpen.length} calls)`);
      probeGaps = whileOpen.slice(1).map((c, i) => c.arrivedAt - whileOpen[i]!.arrivedAt);
    }
  }

  // Attempts started while the lane was open are the upstream's fault during an outage: not charged.
  const whileOpenAttempts = requests.flatMap((request) =>
    request.attempt_rows.filter((attempt) => openedAt !== undefined && attempt.started_at.getTime() >= openedAt + 500 && attempt.started_at.getTime() < upAt && attempt.outcome === 'failed'),
  );
  t.same(
    whileOpenAttempts.filter((attempt) => attempt.charged !== false).map((attempt) => `${attempt.error_code} charged ${attempt.charged}`).slice(0, 10),
    [],
    `none of the ${whileOpenAttempts.length} attempts that failed while the lane was open was charged`,
  );

  const changes = healthChanges(gateway.logs).filter((change) => change.upstream === 'primary');
  t.ok(changes.some((change) => change.to === 'open' && change.model === MODEL && change.reason.length > 0), 'a "lane health changed" log line says it opened, and why');
  t.equal(changes.at(-1)?.to, 'healthy', 'and the last says it is healthy again');
  // One line on each change, and once: each from the health the line before it reached.
  const unchained = changes.slice(1).flatMap((change, i) =>
    change.from === changes[i]!.to ? [] : [`${changes[i]!.from}→${changes[i]!.to}, then ${change.from}→${change.to}`],
  );
  t.same(unchained.slice(0, 5), [], `the log lines chain: each change from the health the line before reached (${unchained.length} breaks)`);

  const metrics = parseMetrics(await (await fetch(`${gateway.metricsUrl}/metrics`)).text());
  const changesCounted = (health: string) =>
    [...metrics]
      .filter(([name]) => name.startsWith('gateway_lane_health_changes_total{') && name.includes('upstream="primary"') && name.includes(`health="${health}"`))
      .reduce((sum, [, value]) => sum + value, 0);
  const counted = Object.fromEntries(HEALTHS.map((health) => [health, changesCounted(health)]));
  t.ok(counted.open! >= 1 && counted.probing! >= 1 && counted.healthy! >= 1, `gateway_lane_health_changes_total counts the changes to open, probing and healthy (${JSON.stringify(counted)})`);

  t.comment(`${scenario.label}: ${count} requests sent over ${seconds(outageMs)} of outage; the upstream was down from 0 to ${seconds(upAt - downAt)}`);
  t.comment(`lane opened ${openedAt === undefined ? 'never' : `${seconds(openedAt - downAt)} into the outage`}; health changes: ${healthPath(changes)} (${changes.length} log lines)`);
  t.comment(`lane_states reads: ${readsPath(reads)}; last_error: ${tally(new Set(reads.map((read) => read.last_error ?? 'null')))}`);
  t.comment(`failed attempts during the outage: ${failedAttempts} (${(failedAttempts / outageSeconds).toFixed(2)}/s); ${tally(requests.flatMap((request) => request.attempt_rows.filter((a) => a.outcome === 'failed').map((a) => `${a.error_code} charged ${a.charged}`)))}`);
  if (scenario.countedAtUpstream) {
    const failedCalls = failedCallsBetween(upstream.calls, downAt, upAt);
    t.comment(`failed calls at the upstream during the outage: ${failedCalls.length} (${(failedCalls.length / outageSeconds).toFixed(2)}/s); gaps between calls while open: ${probeGaps.map((gap) => seconds(gap)).join(', ') || 'none'}`);
  }
  t.comment(`completion after the recovery: ${spread(finishedAfterRecovery.filter((ms) => ms >= 0))}; ${finishedAfterRecovery.filter((ms) => ms < 0).length} completed before it`);
  t.comment(`attempts per request: ${tally(requests.map((request) => request.attempts))}; charged_attempts: ${tally(requests.map((request) => request.charged_attempts))}`);

  return { gateway, upstream, requests, downAt, upAt, openedAt, reads, changes };
}
