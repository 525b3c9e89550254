// Outage 9: a brownout. The only upstream of a model answers 503 to four calls in five (each
// fifth succeeds, every answer after the usual latency) for 90 s while 100 requests wait, then
// recovers. Most of the lane's calls fail, so it opens; each probe that meets a success closes
// it, and the requests waiting start again at once, together, to meet the brownout again. None
// of them is a request failing where others succeed, so none is charged for the brownout: none
// may fail, and all complete, during the brownout or once it is over.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { tally } from '../faults/support/client.ts';
import { queueSummary, waitUntilTerminal } from '../faults/support/rows.ts';
import { completionFor, errorFor, startFakeUpstream, type Script } from '../helpers/upstream.ts';
import {
  healthChanges,
  healthPath,
  LATENCY_MS,
  lifecycleProblems,
  MODEL,
  outageReply,
  post,
  requestsWithAttempts,
  seconds,
  startOutageGateway,
} from './support.ts';

const REQUESTS = 100;
const BROWNOUT_MS = 90_000;
const SUCCEED_EVERY = 5;

/** Four calls in five answered 503, each fifth a completion, all after LATENCY_MS. */
const brownout: Script = (call) =>
  call.count % SUCCEED_EVERY === 0
    ? { status: 200, json: completionFor(call.body), delayMs: LATENCY_MS }
    : { status: 503, json: errorFor(503), delayMs: LATENCY_MS };

t.test('the upstream fails four calls in five (503) for 90 s while 100 requests wait: none fails, all complete', async (t) => {
  const upstream = await startFakeUpstream(t, outageReply({ kind: 'healthy' }));
  // Every answer comes in about 200 ms: the suite's 2 s timeout would only time out a call that
  // this busy test process was slow to get to.
  const gateway = await startOutageGateway(t, [{ name: 'primary', base_url: upstream.baseUrl, models: [MODEL] }], { UPSTREAM_TIMEOUT_MS: '10000' });
  const key = await gateway.createKey({ project: 'outages-brownout', mode: 'live' });
  const warmUp = await post(gateway.url, key, 'brownout warm-up');
  t.ok((await waitUntilTerminal(gateway.pool, [warmUp.body?.id], 10_000)).done, 'before the brownout, a request completes');

  upstream.replyWith(brownout);
  const downAt = Date.now();
  const accepted = await Promise.all(Array.from({ length: REQUESTS }, (_, i) => post(gateway.url, key, `brownout request ${i}`)));
  t.equal(tally(accepted.map((answer) => answer.status)), `202: ${REQUESTS}`, `all ${REQUESTS} acknowledged`);
  const ids = accepted.map((answer) => answer.body?.id as string);
  if (downAt + BROWNOUT_MS > Date.now()) await sleep(downAt + BROWNOUT_MS - Date.now());
  upstream.replyWith(outageReply({ kind: 'healthy' }));
  const upAt = Date.now();

  const ended = await waitUntilTerminal(gateway.pool, ids, 60_000);
  t.ok(ended.done, `all ended (left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);
  if (!ended.done) t.comment(await queueSummary(gateway.pool));
  const requests = await requestsWithAttempts(gateway.pool, ids);
  t.equal(tally(requests.map((request) => request.status)), `completed: ${REQUESTS}`, 'none failed: all completed');
  const problems = requests.flatMap((request) => lifecycleProblems(request).map((problem) => `${request.id}: ${problem}`));
  t.same(problems.slice(0, 20), [], `every request's rows keep the lifecycle and charging rules (${problems.length} problems)`);
  const changes = healthChanges(gateway.logs).filter((change) => change.upstream === 'primary');
  t.ok(changes.some((change) => change.to === 'open'), 'the lane opened during the brownout');

  const during = upstream.calls.filter((call) => call.arrivedAt >= downAt && call.arrivedAt < upAt);
  t.comment(`brownout ${seconds(upAt - downAt)}: ${during.length} calls, ${during.filter((call) => call.status === 200).length} succeeded; health changes: ${healthPath(changes)}`);
  t.comment(`charged_attempts: ${tally(requests.map((request) => request.charged_attempts))}; attempts: ${tally(requests.map((request) => request.attempts))}`);
  t.comment(`completed after the brownout: ${requests.filter((request) => (request.finished_at?.getTime() ?? 0) >= upAt).length}`);
});
