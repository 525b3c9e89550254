// Outage 4: a model with two deployments, primary and secondary (which serves it under its own
// name), each answering in about 300 ms. The primary answers 503 for 120 s while requests keep
// arriving. Every request completes during the outage, on the secondary; those accepted once
// the primary's lane has opened go straight to the secondary (only the primary's probes take one
// of them there first), their acceptance-to-completion p50 within 1 s of the secondary's own
// latency. Once the primary is back and its probe succeeds, new requests run on it again.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import type { Call } from '../faults/support/client.ts';
import { spread, tally } from '../faults/support/client.ts';
import { queueSummary, waitUntilTerminal } from '../faults/support/rows.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import {
  firstOpenedAt,
  healthChanges,
  healthPath,
  HEALTHS,
  readsPath,
  laneState,
  lifecycleProblems,
  MODEL,
  outageReply,
  post,
  requestsWithAttempts,
  seconds,
  setOutage,
  startOutageGateway,
  watchLane,
  type OutageRequest,
} from './support.ts';

const LATENCY_MS = 300;
const OUTAGE_MS = 120_000;
// 500 requests over the 120 s.
const EVERY_MS = 240;
const SECONDARY_MODEL = 'gpt-4o-secondary-deployment';
const BACK_WITHIN_MS = 40_000;
const AFTER_REQUESTS = 20;

const p50 = (values: number[]) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)] ?? NaN;

t.test('two deployments, the primary down (503) for 120 s: every request completes on the secondary, those after the lane opened straight there, then back to the primary', async (t) => {
  const primary = await startFakeUpstream(t, outageReply({ kind: 'healthy' }, LATENCY_MS));
  const secondary = await startFakeUpstream(t, outageReply({ kind: 'healthy' }, LATENCY_MS));
  // Every call here is answered at once (the primary's 503s) or in about 300 ms: the suite's 2 s
  // timeout would only time out a call that this busy test process, where the gateway and both
  // upstreams run, was slow to get to, and fail the secondary for it.
  const gateway = await startOutageGateway(
    t,
    [
      { name: 'primary', base_url: primary.baseUrl, models: [MODEL] },
      { name: 'secondary', base_url: secondary.baseUrl, models: [{ [MODEL]: SECONDARY_MODEL }] },
    ],
    { UPSTREAM_TIMEOUT_MS: '10000' },
  );
  const key = await gateway.createKey({ project: 'outages-fallback', mode: 'live' });

  const warmUp = await post(gateway.url, key, 'fallback warm-up');
  t.equal(warmUp.status, 202);
  const warmed = await waitUntilTerminal(gateway.pool, [warmUp.body.id], 10_000);
  t.ok(warmed.done && primary.calls.length === 1 && secondary.calls.length === 0, 'before the outage, a request runs on the primary');

  const watch = watchLane(gateway.pool, 'primary');
  await setOutage(primary, { kind: 'status', status: 503 });
  const downAt = Date.now();
  let upAt = 0;
  let backAt: number | undefined;
  // Requests arrive at an even pace through the outage, and after it until the primary is
  // healthy again (its probes need requests to carry them).
  const sent: Promise<Call>[] = [];
  for (let i = 0; ; i++) {
    const due = downAt + i * EVERY_MS;
    if (due > Date.now()) await sleep(due - Date.now());
    if (upAt === 0 && Date.now() >= downAt + OUTAGE_MS) {
      await setOutage(primary, { kind: 'healthy' }, LATENCY_MS);
      upAt = Date.now();
    }
    if (upAt !== 0) {
      const read = watch.reads.at(-1);
      if (read && read.at > upAt && read.health === 'healthy') {
        backAt = read.at;
        break;
      }
      if (Date.now() > upAt + BACK_WITHIN_MS) break;
    }
    sent.push(post(gateway.url, key, `fallback request ${i}`));
  }
  const accepted = await Promise.all(sent);
  t.equal(tally(accepted.map((answer) => answer.status)), `202: ${accepted.length}`, `all ${accepted.length} acknowledged`);
  t.ok(backAt !== undefined, `the primary's lane was healthy again within ${seconds(BACK_WITHIN_MS)} of its recovery (${backAt === undefined ? 'not' : seconds(backAt - upAt)})`);

  // New requests, once the primary is healthy again, run on it.
  const after: Call[] = [];
  for (let i = 0; i < AFTER_REQUESTS; i++) {
    after.push(await post(gateway.url, key, `fallback after recovery ${i}`));
    await sleep(100);
  }
  const ids = accepted.map((answer) => answer.body?.id as string);
  const afterIds = after.map((answer) => answer.body?.id as string);
  const ended = await waitUntilTerminal(gateway.pool, [...ids, ...afterIds], 30_000);
  const reads = await watch.stop();
  t.ok(ended.done, `all ended (left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);
  if (!ended.done) t.comment(await queueSummary(gateway.pool));

  const requests = await requestsWithAttempts(gateway.pool, ids);
  t.equal(tally(requests.map((request) => request.status)), `completed: ${ids.length}`, 'none failed: all completed');
  const problems = requests.flatMap((request) => lifecycleProblems(request).map((problem) => `${request.id}: ${problem}`));
  t.same(problems.slice(0, 20), [], `every request's rows keep the lifecycle and charging rules (${problems.length} problems)`);

  const success = (request: OutageRequest) => request.attempt_rows.find((attempt) => attempt.outcome === 'succeeded');
  const duringOutage = requests.filter((request) => request.created_at.getTime() < upAt);
  t.same(
    duringOutage.filter((request) => request.created_at.getTime() < upAt - 5_000 && !((request.finished_at?.getTime() ?? Infinity) < upAt)).map((request) => request.id).slice(0, 10),
    [],
    `every request accepted during the outage (up to 5 s before its end) completed during it (${duringOutage.length} accepted)`,
  );
  const finishedDuring = requests.filter((request) => (request.finished_at?.getTime() ?? Infinity) < upAt);
  t.same(
    tally(finishedDuring.map((request) => String(success(request)?.upstream))),
    `secondary: ${finishedDuring.length}`,
    `on the secondary (${finishedDuring.length} completed during the outage)`,
  );

  const openedAt = firstOpenedAt(reads);
  t.ok(openedAt !== undefined, `the primary's lane opened (${openedAt === undefined ? 'never' : `${seconds(openedAt - downAt)} into the outage`})`);
  const afterOpen = requests.filter((request) => openedAt !== undefined && request.created_at.getTime() > openedAt && request.created_at.getTime() < upAt - 2_000);
  // The primary's probes each take a waiting request there first; every other request goes
  // straight to the secondary.
  const probed = afterOpen.filter((request) => request.attempt_rows.some((attempt) => attempt.upstream === 'primary'));
  const straight = afterOpen.filter((request) => !probed.includes(request));
  t.same(
    straight
      .filter((request) => request.attempt_rows.length !== 1 || request.attempt_rows[0]!.upstream !== 'secondary')
      .map((request) => request.attempt_rows.map((attempt) => `${attempt.upstream} ${attempt.outcome}${attempt.error_code ? ` (${attempt.error_code}: ${attempt.error_detail})` : ''}`).join(', '))
      .slice(0, 10),
    [],
    `accepted after the lane opened: one attempt, on the secondary (${straight.length} of ${afterOpen.length}; the other ${probed.length} carried a probe of the primary first)`,
  );
  const primaryCallsWhileOpen = primary.calls.filter((call) => openedAt !== undefined && call.arrivedAt > openedAt && call.arrivedAt < upAt);
  t.ok(probed.length <= primaryCallsWhileOpen.length, `no more requests went to the primary than it had probe calls (${probed.length} requests, ${primaryCallsWhileOpen.length} calls)`);
  t.same(
    probed.flatMap((request) => request.attempt_rows.filter((attempt) => attempt.upstream === 'primary' && attempt.outcome === 'failed' && attempt.charged !== false)).length,
    0,
    'no probe was charged to its request',
  );

  const secondaryLatency = secondary.calls.map((call) => (call.endedAt ?? Date.now()) - call.arrivedAt);
  const acceptToCompletion = afterOpen.map((request) => request.finished_at!.getTime() - request.created_at.getTime());
  t.ok(
    p50(acceptToCompletion) <= p50(secondaryLatency) + 1_000,
    `their acceptance-to-completion p50 (${p50(acceptToCompletion)} ms) is within 1 s of the secondary's own latency (p50 ${p50(secondaryLatency)} ms)`,
  );

  t.same(tally(secondary.calls.map((call) => call.body.model)), `${SECONDARY_MODEL}: ${secondary.calls.length}`, 'the secondary was asked for its own name of the model');
  t.same(tally(primary.calls.map((call) => call.body.model)), `${MODEL}: ${primary.calls.length}`, 'the primary for the public name');

  const afterRequests = await requestsWithAttempts(gateway.pool, afterIds);
  t.same(
    tally(afterRequests.map((request) => `${request.status} on ${request.attempt_rows.map((attempt) => attempt.upstream).join('+')}`)),
    `completed on primary: ${AFTER_REQUESTS}`,
    `the ${AFTER_REQUESTS} requests sent once it was healthy again each ran once, on the primary`,
  );
  const lastOnSecondary = Math.max(...requests.filter((request) => success(request)?.upstream === 'secondary').map((request) => request.created_at.getTime()));
  t.equal((await laneState(gateway.pool, 'secondary'))?.health, 'healthy', 'the secondary\'s lane is healthy');
  t.same(
    [...new Set(reads.filter((read) => !HEALTHS.includes(read.health)).map((read) => read.health))],
    [],
    `lane_states showed only ${HEALTHS.join(', ')} for the primary's lane, the file listing it throughout`,
  );

  const changes = healthChanges(gateway.logs);
  t.comment(`primary lane opened ${openedAt === undefined ? 'never' : seconds(openedAt - downAt)} into the outage; healthy again ${backAt === undefined ? 'not within the bound' : seconds(backAt - upAt)} after it ended`);
  t.comment(`primary lane reads: ${readsPath(reads)}`);
  t.comment(`health changes: primary ${healthPath(changes.filter((change) => change.upstream === 'primary'))}; secondary ${healthPath(changes.filter((change) => change.upstream === 'secondary'))}`);
  t.comment(`${requests.length} requests: succeeded on ${tally(requests.map((request) => String(success(request)?.upstream)))}; attempts ${tally(requests.map((request) => request.attempt_rows.map((attempt) => attempt.upstream).join('+')))}`);
  t.comment(`accepted after the lane opened: ${afterOpen.length}, ${probed.length} of them probes; acceptance to completion ${spread(acceptToCompletion)}; secondary latency ${spread(secondaryLatency)}`);
  const timeline = (request: OutageRequest) =>
    request.attempt_rows.map((attempt) => `${attempt.upstream} ${attempt.outcome}${attempt.charged ? ' charged' : ''} at +${seconds(attempt.started_at.getTime() - request.created_at.getTime())}`).join(', ');
  t.comment(`requests that carried a probe of the primary: acceptance to completion ${spread(probed.map((request) => request.finished_at!.getTime() - request.created_at.getTime()))}`);
  for (const request of requests.filter((row) => row.attempt_rows.filter((attempt) => attempt.upstream === 'primary').length >= 2).slice(0, 3)) {
    t.comment(`  tried on the primary more than once: accepted ${seconds(request.created_at.getTime() - downAt)} into the outage: ${timeline(request)}`);
  }
  t.comment(`primary calls during the outage: ${primary.calls.filter((call) => call.arrivedAt >= downAt && call.arrivedAt < upAt).length}; the last request that completed on the secondary was accepted ${seconds(lastOnSecondary - upAt)} after the recovery`);
});
