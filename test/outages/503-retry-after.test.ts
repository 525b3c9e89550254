// Outage 10: the only upstream of a model answers 503 with `retry-after: 3600` for 30 s while 50
// requests arrive, then recovers. A 503 is the provider's failure, which the lane's health
// answers: the lane opens and probes, at its own intervals, and its waiting requests start again
// as soon as a probe succeeds. None may wait out the hour that the 503s asked for: all complete
// within 30 s of the recovery.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { spread, tally } from '../faults/support/client.ts';
import { queueSummary, waitUntilTerminal } from '../faults/support/rows.ts';
import { errorFor, startFakeUpstream } from '../helpers/upstream.ts';
import { lifecycleProblems, MODEL, outageReply, post, requestsWithAttempts, seconds, sendSpread, startOutageGateway } from './support.ts';

const REQUESTS = 50;
const OUTAGE_MS = 30_000;
const RECOVERY_BOUND_MS = 30_000;

t.test('the upstream answers 503 with retry-after: 3600 for 30 s while 50 requests arrive: all complete within 30 s of recovery', async (t) => {
  const upstream = await startFakeUpstream(t, outageReply({ kind: 'healthy' }));
  const gateway = await startOutageGateway(t, [{ name: 'primary', base_url: upstream.baseUrl, models: [MODEL] }]);
  const key = await gateway.createKey({ project: 'outages-503-retry-after', mode: 'live' });

  upstream.replyWith(() => ({ status: 503, json: errorFor(503), headers: { 'retry-after': '3600' } }));
  const downAt = Date.now();
  const accepted = await sendSpread(gateway.url, key, { count: REQUESTS, overMs: 5_000, content: (i) => `503 retry-after request ${i}` });
  t.equal(tally(accepted.map((answer) => answer.status)), `202: ${REQUESTS}`, `all ${REQUESTS} acknowledged`);
  const ids = accepted.map((answer) => answer.body?.id as string);
  if (downAt + OUTAGE_MS > Date.now()) await sleep(downAt + OUTAGE_MS - Date.now());
  upstream.replyWith(outageReply({ kind: 'healthy' }));
  const upAt = Date.now();

  const ended = await waitUntilTerminal(gateway.pool, ids, RECOVERY_BOUND_MS);
  t.ok(ended.done, `all ended within ${seconds(RECOVERY_BOUND_MS)} of the recovery (left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);
  if (!ended.done) t.comment(await queueSummary(gateway.pool));
  const requests = await requestsWithAttempts(gateway.pool, ids);
  t.equal(tally(requests.map((request) => request.status)), `completed: ${REQUESTS}`, 'all completed');
  const problems = requests.flatMap((request) => lifecycleProblems(request).map((problem) => `${request.id}: ${problem}`));
  t.same(problems.slice(0, 20), [], `every request's rows keep the lifecycle and charging rules (${problems.length} problems)`);

  const { rows: waiting } = await gateway.pool.query<{ id: string; waits_s: number }>(
    `select id, extract(epoch from next_attempt_at - now())::float8 as waits_s from gateway.requests where id = any($1::text[]) and status = 'retrying'`,
    [ids],
  );
  t.comment(`still retrying: ${waiting.length}, next attempts in ${spread(waiting.map((row) => row.waits_s * 1000))}`);
  t.comment(`attempts per request: ${tally(requests.map((request) => request.attempts))}; completed after the recovery: ${spread(requests.filter((r) => r.finished_at).map((r) => r.finished_at!.getTime() - upAt))}`);
});
