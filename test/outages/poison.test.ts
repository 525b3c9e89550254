// Outage 5, which is not one: a "poison" request whose body makes the upstream answer 500, while
// the other requests (a steady few a second) succeed. Its failures are charged: it fails after
// MAX_ATTEMPTS (5 charged attempts, upstream_server_error), and the lane never opens (healthy at
// every read of gateway.lane_states, no 'lane health changed' log line).
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import type { Call } from '../faults/support/client.ts';
import { tally } from '../faults/support/client.ts';
import { waitUntilTerminal } from '../faults/support/rows.ts';
import { completionAfter, errorFor, startFakeUpstream } from '../helpers/upstream.ts';
import { healthChanges, readsPath, lifecycleProblems, MAX_ATTEMPTS, MODEL, post, requestsWithAttempts, seconds, startOutageGateway, watchLane } from './support.ts';

const POISON = 'POISON';
const STEADY_EVERY_MS = 300;

t.test('a poison request fails after 5 charged attempts while others succeed, and the lane never opens', async (t) => {
  const healthy = completionAfter(100);
  const upstream = await startFakeUpstream(t, (call) => (call.content.includes(POISON) ? { status: 500, json: errorFor(500) } : healthy(call)));
  const gateway = await startOutageGateway(t, [{ name: 'primary', base_url: upstream.baseUrl, models: [MODEL] }]);
  const key = await gateway.createKey({ project: 'outages-poison', mode: 'live' });
  const watch = watchLane(gateway.pool, 'primary', MODEL, 100);

  let stopped = false;
  const steady: Promise<Call>[] = [];
  const steadyLoop = (async () => {
    for (let i = 0; !stopped; i++) {
      steady.push(post(gateway.url, key, `poison scenario, steady request ${i}`));
      await sleep(STEADY_EVERY_MS);
    }
  })();

  await sleep(2_000);
  const sentAt = Date.now();
  const poison = await post(gateway.url, key, `poison scenario: this one carries ${POISON}`);
  t.equal(poison.status, 202, 'the poison request is acknowledged');
  const poisonId = poison.body?.id as string;
  // Its 4 waits, with full jitter, are at most 1 + 2 + 4 + 8 s.
  const ended = await waitUntilTerminal(gateway.pool, [poisonId], 40_000);
  t.ok(ended.done, `the poison request ended (${JSON.stringify(ended.byStatus)})`);
  const endedAfter = Date.now() - sentAt;
  // Steady traffic goes on a little after it, as it would.
  await sleep(2_000);
  stopped = true;
  await steadyLoop;
  const steadyAnswers = await Promise.all(steady);
  const steadyIds = steadyAnswers.map((answer) => answer.body?.id as string);
  const steadyEnded = await waitUntilTerminal(gateway.pool, steadyIds, 15_000);
  const reads = await watch.stop();

  const [request] = await requestsWithAttempts(gateway.pool, [poisonId]);
  t.match(request, { status: 'failed', charged_attempts: MAX_ATTEMPTS, last_error_code: 'upstream_server_error' }, 'failed after MAX_ATTEMPTS charged attempts, with upstream_server_error');
  const attempts = request?.attempt_rows ?? [];
  t.same(
    attempts.map((attempt) => ({ outcome: attempt.outcome, error_code: attempt.error_code, upstream: attempt.upstream })),
    Array(attempts.length).fill({ outcome: 'failed', error_code: 'upstream_server_error', upstream: 'primary' }),
    'each of its attempts failed on the primary',
  );
  // A retry that ends before any other call has succeeded since the poison's previous failure
  // has nothing to show that the lane works without it: that attempt is not charged, and the
  // request gets one more. With full jitter a retry can come within a few milliseconds, so this
  // happens now and then; the first attempt (the lane's last call had succeeded) and the last
  // (the one that reached MAX_ATTEMPTS) are always charged.
  t.ok(attempts.length >= MAX_ATTEMPTS, `${attempts.length} attempts, at least MAX_ATTEMPTS`);
  t.equal(attempts[0]?.charged, true, 'its first attempt was charged');
  t.equal(attempts.at(-1)?.charged, true, 'and its last');
  t.same(request ? lifecycleProblems(request) : ['not stored'], [], 'its rows keep the rules');
  const poisonCalls = upstream.calls.filter((call) => call.content.includes(POISON));
  t.equal(poisonCalls.length, attempts.length, 'the upstream was called once per attempt');

  t.equal(tally(steadyAnswers.map((answer) => answer.status)), `202: ${steady.length}`, `the ${steady.length} steady requests were acknowledged`);
  t.ok(steadyEnded.done, `and all ended (${JSON.stringify(steadyEnded.byStatus)})`);
  const steadyRequests = await requestsWithAttempts(gateway.pool, steadyIds);
  t.equal(tally(steadyRequests.map((row) => `${row.status} after ${row.attempts}`)), `completed after 1: ${steady.length}`, 'each completed at its first attempt');

  t.ok(reads.length > 50, `the lane was read ${reads.length} times`);
  t.equal(tally(reads.map((read) => read.health)), `healthy: ${reads.length}`, 'and was healthy at every read');
  t.same(healthChanges(gateway.logs), [], 'no "lane health changed" log line');

  const gaps = poisonCalls.slice(1).map((call, i) => call.arrivedAt - poisonCalls[i]!.arrivedAt);
  t.comment(`poison request: failed after ${seconds(endedAfter)}, ${request?.attempts} attempts (${request?.charged_attempts} charged), waits between them ${gaps.map((gap) => seconds(gap)).join(', ')}`);
  t.comment(`steady requests: ${steady.length}, one every ${STEADY_EVERY_MS} ms; lane reads: ${readsPath(reads)}`);
});
