// Outage 7: two worker processes, the lane open and probing, and the worker that holds the probe
// call killed with SIGKILL. The upstream hangs calls at that moment, so the probe is known to be
// in flight (gateway.request_attempts.worker_id says whose). The other worker goes on probing
// (the upstream sees new probe calls, from it), one call at a time across both, and once the
// upstream is back every request completes: nothing lost.
import t from 'tap';
import { call, spread, tally } from '../faults/support/client.ts';
import { faultContext } from '../faults/support/context.ts';
import { queueSummary, waitUntilTerminal } from '../faults/support/rows.ts';
import { privateContent } from '../faults/support/run.ts';
import type { GatewayProcess } from '../helpers/serve.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';
import {
  DEFAULT_RETRIES,
  laneState,
  lifecycleProblems,
  MODEL,
  outageReply,
  peakOverlap,
  requestsWithAttempts,
  seconds,
  sendSpread,
  setOutage,
  writeUpstreamsFile,
} from './support.ts';

const SCENARIO = 'outage-worker-killed-while-probing';
const REQUESTS = 100;
const RECOVERY_BOUND_MS = 30_000;

/** The pid in a worker id (`worker-<host>-<pid>-<hex>`). */
const pidOf = (workerId: string) => Number(/-(\d+)-[0-9a-f]+$/.exec(workerId)?.[1]);

t.test('two workers, the lane probing, the worker holding the probe killed with SIGKILL: the other goes on probing, and after recovery every request completes', async (t) => {
  const upstream = await startFakeUpstream(t, outageReply({ kind: 'healthy' }));
  const file = await writeUpstreamsFile(t, [{ name: 'primary', base_url: upstream.baseUrl, models: [MODEL] }]);
  const faults = await faultContext(t, SCENARIO);
  const env = {
    ...DEFAULT_RETRIES,
    UPSTREAMS_FILE: file,
    // The probe hangs until the kill, not until a timeout.
    UPSTREAM_TIMEOUT_MS: '60000',
  };
  const api = await faults.start('api', { env });
  const workers: GatewayProcess[] = [
    await faults.start('worker', { label: 'worker-a', env }),
    await faults.start('worker', { label: 'worker-b', env }),
  ];
  const key = await faults.createKey({ project: 'outages-worker-killed', mode: 'live' });
  const warmUp = await call(api.url!, {
    path: '/v1/chat/completions',
    key,
    body: { model: MODEL, messages: [{ role: 'user', content: privateContent('outage 7 warm-up') }], wait: true },
  });
  t.equal(warmUp.status, 200, 'before the outage, a request completes');

  await setOutage(upstream, { kind: 'status', status: 503 });
  const downAt = Date.now();
  const accepted = await sendSpread(api.url!, key, { count: REQUESTS, overMs: 5_000, content: (i) => privateContent(`outage 7 request ${i}`) });
  t.equal(tally(accepted.map((answer) => answer.status)), `202: ${REQUESTS}`, `all ${REQUESTS} acknowledged`);
  const ids = accepted.map((answer) => answer.body?.id as string);

  let lane = await laneState(faults.pool, 'primary');
  await until(async () => {
    lane = await laneState(faults.pool, 'primary');
    return lane?.health === 'open' || lane?.health === 'probing';
  }, () => `the lane to open (last read: ${JSON.stringify(lane)})`, 30_000);
  const openedAt = lane?.health_since?.getTime() ?? Date.now();
  // Calls claimed just before the lane opened may still be starting (a loaded machine starts a
  // claim's calls over a while), and each fails at once: once none is running, what runs is a
  // probe.
  await until(
    async () => (await faults.pool.query(`select from gateway.request_attempts where outcome = 'running'`)).rowCount === 0,
    'the calls claimed before the lane opened to end',
    30_000,
  );
  const settledAt = Date.now();

  // From now on a call hangs: the next probe stays in flight.
  await setOutage(upstream, { kind: 'hang' });
  const hangAt = Date.now();
  await until(async () => {
    lane = await laneState(faults.pool, 'primary');
    return lane?.health === 'probing' && upstream.calls.some((c) => c.arrivedAt >= hangAt && c.endedAt === undefined);
  }, () => `a probe call in flight (lane: ${JSON.stringify(lane)}; calls since: ${upstream.calls.filter((c) => c.arrivedAt >= hangAt).length})`, 40_000);
  const { rows: running } = await faults.pool.query<{ request_id: string; attempt_number: number; worker_id: string; upstream: string | null }>(
    `select request_id, attempt_number, worker_id, upstream from gateway.request_attempts where outcome = 'running'`,
  );
  t.equal(running.length, 1, `one attempt running: the probe (${JSON.stringify(running)})`);
  const probe = running[0]!;
  const holder = workers.find((worker) => worker.pid === pidOf(probe.worker_id));
  const survivor = workers.find((worker) => worker !== holder)!;
  t.ok(holder, `the probe is held by ${holder?.label} (${probe.worker_id})`);
  if (!holder) return;

  const killedAt = Date.now();
  const exit = await holder.kill('SIGKILL');
  t.equal(exit?.signal, 'SIGKILL', `${holder.label} died of SIGKILL`);
  // Still down, but answering at once: each probe from now on is seen and fails.
  await setOutage(upstream, { kind: 'status', status: 503 });
  await until(
    () => upstream.calls.some((c) => c.arrivedAt > killedAt),
    () => `a new probe call after the kill (lane: ${JSON.stringify(lane)})`,
    45_000,
  );
  const nextProbe = upstream.calls.find((c) => c.arrivedAt > killedAt)!;
  // One more, to see the probing go on.
  await until(() => upstream.calls.filter((c) => c.arrivedAt > killedAt).length >= 2, 'a second probe call after the kill', 30_000).catch(() => {});
  const probesAfterKill = upstream.calls.filter((c) => c.arrivedAt > killedAt);

  const { rows: startedAfter } = await faults.pool.query<{ worker_id: string }>(
    `select worker_id from gateway.request_attempts where started_at > to_timestamp($1 / 1000.0)`,
    [killedAt],
  );
  t.ok(startedAfter.length >= 1, `attempts started after the kill (${startedAfter.length})`);
  t.same(
    [...new Set(startedAfter.map((row) => pidOf(row.worker_id)))],
    [survivor.pid],
    `all by the other worker, ${survivor.label}`,
  );
  const whileOpen = upstream.calls.filter((c) => c.arrivedAt >= settledAt);
  t.ok(peakOverlap(whileOpen) <= 1, `one call at a time across both workers while the lane was open (peak ${peakOverlap(whileOpen)} of ${whileOpen.length} calls)`);

  await setOutage(upstream, { kind: 'healthy' });
  const upAt = Date.now();
  const ended = await waitUntilTerminal(faults.pool, ids, RECOVERY_BOUND_MS + 30_000);
  t.ok(ended.done, `all ended (left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);
  if (!ended.done) t.comment(await queueSummary(faults.pool));
  const requests = await requestsWithAttempts(faults.pool, ids);
  t.equal(requests.length, REQUESTS, 'every acknowledged id is stored');
  t.equal(tally(requests.map((request) => request.status)), `completed: ${REQUESTS}`, 'all completed: nothing lost');
  const problems = requests.flatMap((request) => lifecycleProblems(request).map((problem) => `${request.id}: ${problem}`));
  t.same(problems.slice(0, 20), [], `every request's rows keep the rules (${problems.length} problems)`);
  const finished = requests.map((request) => (request.finished_at?.getTime() ?? Date.now()) - upAt);
  t.ok(Math.max(...finished) <= RECOVERY_BOUND_MS, `all within ${seconds(RECOVERY_BOUND_MS)} of the recovery (the last ${seconds(Math.max(...finished))})`);
  const lost = requests.find((request) => request.id === probe.request_id)?.attempt_rows.find((attempt) => attempt.attempt_number === probe.attempt_number);
  t.match(lost, { outcome: 'failed', error_code: 'worker_lost' }, 'the killed probe is recorded as worker_lost');
  t.equal((await laneState(faults.pool, 'primary'))?.health, 'healthy', 'the lane is healthy again');

  t.comment(`lane opened ${seconds(openedAt - downAt)} into the outage; the probe held by ${holder.label} (${probe.worker_id}) was killed ${seconds(killedAt - hangAt)} after calls began to hang`);
  t.comment(`next probe call ${seconds(nextProbe.arrivedAt - killedAt)} after the kill; ${probesAfterKill.length} probe calls from the kill to the recovery, gaps ${probesAfterKill.slice(1).map((c, i) => seconds(c.arrivedAt - probesAfterKill[i]!.arrivedAt)).join(', ') || 'none'}`);
  t.comment(`completion after the recovery: ${spread(finished)}; attempts per request ${tally(requests.map((request) => request.attempts))}; charged ${tally(requests.map((request) => request.charged_attempts))}`);
  await faults.finish(t);
});
