// Lane health and deployments, over short outages of loopback upstreams: a lane whose provider
// fails opens, its requests wait uncharged while one probe at a time tries it, and a probe that
// succeeds closes it; a model's second deployment takes its requests while the first is open;
// a request failing alone where others succeed (poison) is charged and fails, and the lane stays
// healthy; a renamed model reaches its upstream under the upstream's own name.
import { setTimeout as sleep } from 'node:timers/promises';
import t, { type Test } from 'tap';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { dispatchJobs, waitingOnLock } from '../helpers/rows.ts';
import { completionFor, startFakeUpstream, type FakeUpstream } from '../helpers/upstream.ts';
import { upstreamsFile } from '../helpers/upstreams-file.ts';
import { until } from '../helpers/wait.ts';

/** An upstream that answers 503 while `down`, and completions otherwise. */
async function switchableUpstream(t: Test) {
  const state = { down: false, failed: 0 };
  const upstream = await startFakeUpstream(t, (call) => {
    if (state.down) {
      state.failed++;
      return { status: 503 };
    }
    return { status: 200, json: completionFor(call.body) };
  });
  return Object.assign(upstream, { state });
}

async function laneState(gateway: TestGateway, upstream: string) {
  const { rows } = await gateway.pool.query('select * from gateway.lane_states where upstream = $1', [upstream]);
  return rows[0];
}

async function requestRows(gateway: TestGateway, ids: string[]) {
  const { rows } = await gateway.pool.query(
    'select id, status, attempts, charged_attempts, last_error_code from gateway.requests where id = any($1) order by id',
    [ids],
  );
  return rows;
}

const allCompleted = (gateway: TestGateway, ids: string[]) => async () =>
  (await requestRows(gateway, ids)).every((row) => row.status === 'completed');

async function submit(gateway: TestGateway, key: Awaited<ReturnType<TestGateway['createKey']>>, model: string, count: number, label: string) {
  const client = clientFor(gateway.url, key);
  return Promise.all(
    Array.from({ length: count }, async (_, i) => {
      const answer = await client.post({ model, messages: userMessage(`${label} ${i}`) });
      if (answer.status !== 202) throw new Error(`not accepted: ${answer.status}`);
      return answer.body.id as string;
    }),
  );
}

t.test('a failing provider opens its lane: requests wait uncharged, probes go one at a time, a probe that succeeds closes it', async (t) => {
  const upstream = await switchableUpstream(t);
  const file = await upstreamsFile(t, [{ name: 'primary', base_url: upstream.baseUrl, models: ['gpt-test'] }]);
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: file, MAX_ATTEMPTS: '3', METRICS_PORT: '0' } });
  const key = await gateway.createKey({ mode: 'live' });

  upstream.state.down = true;
  const ids = await submit(gateway, key, 'gpt-test', 8, 'outage');
  await until(async () => ['open', 'probing'].includes((await laneState(gateway, 'primary'))?.health), 'the lane to open', 10_000);
  const open = await laneState(gateway, 'primary');
  t.match(open, { health: /^(open|probing)$/, last_error: 'upstream_server_error: upstream answered HTTP 503' }, 'the lane says why it is open');
  t.ok(open.health_since instanceof Date, 'and since when');

  // Probes: at most one call in flight, about one in the first seconds (1 s after the opening,
  // then 2 s after that, ...). Counted from half a second after the opening was seen, so that the
  // failures of calls already on their way when the lane opened are not taken for probes.
  await sleep(500);
  const failedBefore = upstream.state.failed;
  await sleep(3_000);
  const probes = upstream.state.failed - failedBefore;
  t.ok(probes >= 1 && probes <= 3, `${probes} probes in 3 s while open`);
  const waiting = await requestRows(gateway, ids);
  t.ok(waiting.every((row) => row.status === 'queued' || row.status === 'retrying'), 'no request failed: they wait');
  t.ok(waiting.every((row) => row.charged_attempts <= 1), `at most the first failure charged: ${waiting.map((row) => row.charged_attempts)}`);

  upstream.state.down = false;
  await until(allCompleted(gateway, ids), 'every request to complete after the provider is back', 20_000);
  t.equal((await laneState(gateway, 'primary')).health, 'healthy', 'a probe that succeeded closed the lane');

  const changes = gateway.logs.map((line) => JSON.parse(line)).filter((line) => line.msg === 'lane health changed');
  t.match(changes[0], { upstream: 'primary', model: 'gpt-test', from: 'healthy', to: 'open', reason: /upstream_server_error/ });
  t.match(changes.at(-1), { upstream: 'primary', to: 'healthy' });
  const metrics = parseMetrics(await (await fetch(`${gateway.metricsUrl}/metrics`)).text());
  t.ok((metrics.get('gateway_lane_health_changes_total{upstream="primary",health="open"}') ?? 0) >= 1, 'the metric counts the opening');
  t.ok((metrics.get('gateway_lane_health_changes_total{upstream="primary",health="healthy"}') ?? 0) >= 1, 'and the closing');
});

for (const ending of ['cancelled', 'failed for its deadline'] as const) {
  t.test(`a probe whose request is ${ending} during its call has its lane's queue dispatched: the lane opens again, logged and counted, the next probe starts, and the waiting requests complete`, async (t) => {
    // Down: 503 at once. Holding: each call held until the gateway gives it up. Up: completions
    // (a call held before stays held).
    const state = { mode: 'down' as 'down' | 'holding' | 'up', held: 0 };
    const upstream = await startFakeUpstream(t, (call) => {
      if (state.mode === 'down') return { status: 503 };
      if (state.mode === 'holding') {
        state.held++;
        return { hang: true };
      }
      return { status: 200, json: completionFor(call.body) };
    });
    const file = await upstreamsFile(t, [{ name: 'primary', base_url: upstream.baseUrl, models: ['gpt-test'] }]);
    // WORKER_DEAD_AFTER_MS of a minute keeps the rescue of stranded queues (worker/rescue.ts) out
    // of the way: the dispatch must come from the probe's end.
    const gateway = await startTestGateway(t, {
      env: { UPSTREAMS_FILE: file, UPSTREAM_TIMEOUT_MS: '30000', WORKER_DEAD_AFTER_MS: '60000', METRICS_PORT: '0' },
    });
    // The requests that open the lane, one of which is its probe; for the deadline's case, of a
    // key whose requests fail 3 s after their acceptance, their probe among them.
    const first = await gateway.createKey({ mode: 'live', ...(ending === 'cancelled' ? {} : { deadlineMs: 3_000 }) });
    const opening = await submit(gateway, first, 'gpt-test', 6, 'opening');
    await until(async () => (await laneState(gateway, 'primary'))?.health === 'open', 'the lane to open', 10_000);
    // Requests that wait for the lane, of a key without a short deadline; none is accepted after
    // the probe ends (an acceptance dispatches the queue itself).
    const waiting = await submit(gateway, await gateway.createKey({ mode: 'live' }), 'gpt-test', 4, 'waiting');
    state.mode = 'holding';
    await until(async () => (await laneState(gateway, 'primary'))?.health === 'probing' && state.held === 1, 'a probe to start', 10_000);
    const { rows: lanes } = await gateway.pool.query<{ probe_request_id: string }>('select probe_request_id from gateway.lanes where upstream = $1', ['primary']);
    const probe = lanes[0]!.probe_request_id;
    t.ok(opening.includes(probe), 'the probe is one of the requests that opened the lane');
    // The provider is back: only the probe's call, held, keeps the lane from finding out.
    state.mode = 'up';

    // Nothing else is to dispatch the queue by then: the retries of the requests that opened the
    // lane were dispatched (their jobs and this process's timers are due together), and found it
    // probing.
    await until(async () => (await dispatchJobs(gateway.db)).length === 0, 'the dispatches due to have run', 10_000);
    await sleep(1_000);

    if (ending === 'cancelled') {
      t.equal((await send(gateway.url, { method: 'POST', path: `/v1/requests/${probe}/cancel`, key: first })).status, 200, 'its request is cancelled');
    }
    await until(async () => (await requestRows(gateway, [probe]))[0].status !== 'processing', 'the probe\'s request to end', 10_000);
    t.match((await requestRows(gateway, [probe]))[0], ending === 'cancelled' ? { status: 'cancelled' } : { status: 'failed', last_error_code: 'deadline_exceeded' });

    await until(allCompleted(gateway, waiting), 'the waiting requests to complete, after a new probe', 15_000);
    t.pass('the requests waiting for the lane completed');
    t.equal((await laneState(gateway, 'primary')).health, 'healthy', 'the next probe closed the lane');

    // The probe that ended without a word is told as every change of health is: the claim that
    // finds it ended opens the lane again (logged and counted), before the next probe starts.
    const changes = gateway.logs.map((line) => JSON.parse(line)).filter((line) => line.msg === 'lane health changed');
    t.same(
      changes.slice(-4).map((change) => `${change.from} -> ${change.to}`),
      ['open -> probing', 'probing -> open', 'open -> probing', 'probing -> healthy'],
      'the lost probe, then the next one that closed the lane',
    );
    t.match(changes.at(-3), { upstream: 'primary', model: 'gpt-test', from: 'probing', to: 'open', reason: /upstream_server_error/ });
    const metrics = parseMetrics(await (await fetch(`${gateway.metricsUrl}/metrics`)).text());
    t.equal(
      metrics.get('gateway_lane_health_changes_total{upstream="primary",health="open"}'),
      changes.filter((change) => change.to === 'open').length,
      'each opening logged is counted, the lost probe\'s among them',
    );
  });
}

t.test('a model\'s second deployment takes its requests while the first is open, and the first takes them back once it recovers', async (t) => {
  const primary = await switchableUpstream(t);
  const secondary = await switchableUpstream(t);
  const file = await upstreamsFile(t, [
    { name: 'primary', base_url: primary.baseUrl, models: ['gpt-test'] },
    { name: 'secondary', base_url: secondary.baseUrl, models: [{ 'gpt-test': 'gpt-test-on-secondary' }] },
  ]);
  // (an upstream timeout far above a loaded machine's delays: only the 503s are failures here)
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: file, UPSTREAM_TIMEOUT_MS: '10000' } });
  const key = await gateway.createKey({ mode: 'live' });

  const before = await submit(gateway, key, 'gpt-test', 3, 'before');
  await until(allCompleted(gateway, before), 'the first requests to complete');
  t.equal(primary.calls.length, 3, 'the first deployment is preferred');
  t.equal(secondary.calls.length, 0);

  primary.state.down = true;
  const during = await submit(gateway, key, 'gpt-test', 10, 'during');
  await until(allCompleted(gateway, during), 'the requests to complete during the outage', 15_000);
  t.ok(['open', 'probing'].includes((await laneState(gateway, 'primary')).health), 'the first deployment is open');
  t.ok(secondary.calls.length >= 1, `the second took ${secondary.calls.length}`);
  t.ok(secondary.calls.every((call: FakeUpstream['calls'][number]) => call.body.model === 'gpt-test-on-secondary'), 'under its own name for the model');
  const { rows: attempts } = await gateway.pool.query(
    `select upstream, outcome, count(*)::int as count from gateway.request_attempts where request_id = any($1) group by 1, 2 order by 1, 2`,
    [during],
  );
  t.match(attempts.find((row) => row.upstream === 'secondary'), { outcome: 'succeeded', count: 10 }, 'every request completed on the second');

  // A probe is one of the model's requests: with traffic, the first lane's next probe succeeds.
  primary.state.down = false;
  const traffic: string[] = [];
  await until(
    async () => {
      traffic.push(...(await submit(gateway, key, 'gpt-test', 1, 'traffic')));
      return (await laneState(gateway, 'primary')).health === 'healthy';
    },
    'a probe to close the first lane',
    20_000,
  );
  await until(allCompleted(gateway, traffic), 'the requests sent meanwhile to complete');
  const primaryCalls = primary.calls.length;
  const secondaryCalls = secondary.calls.length;
  const after = await submit(gateway, key, 'gpt-test', 3, 'after');
  await until(allCompleted(gateway, after), 'the last requests to complete');
  if (primary.calls.length - primaryCalls !== 3) {
    t.comment(JSON.stringify(gateway.logs.filter((line) => line.includes('lane health changed') || line.includes('attempt failed')).slice(-30), null, 1));
    t.comment(JSON.stringify((await gateway.pool.query('select * from gateway.lane_states')).rows));
  }
  t.equal(primary.calls.length - primaryCalls, 3, 'traffic moved back to the first');
  t.equal(secondary.calls.length - secondaryCalls, 0);
});

t.test('a poison request is charged and fails after MAX_ATTEMPTS, while the lane stays healthy', async (t) => {
  const upstream = await startFakeUpstream(t, (call) =>
    JSON.stringify(call.body).includes('POISON') ? { status: 500 } : { status: 200, json: completionFor(call.body) },
  );
  const file = await upstreamsFile(t, [{ name: 'primary', base_url: upstream.baseUrl, models: ['gpt-test'] }]);
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: file, MAX_ATTEMPTS: '5', RETRY_BASE_MS: '300', RETRY_MAX_MS: '600' } });
  const key = await gateway.createKey({ mode: 'live' });
  const [poison] = await submit(gateway, key, 'gpt-test', 1, 'POISON');
  const healthy: string[] = [];
  let lanes = new Set<string>();
  // Other requests succeed on the lane all along, several between two of the poison request's
  // attempts however slow the machine: its attempts are then charged.
  const poisonFailed = async () => (await requestRows(gateway, [poison!]))[0].status === 'failed';
  for (let i = 0; i < 200 && !(await poisonFailed()); i++) {
    healthy.push(...(await submit(gateway, key, 'gpt-test', 2, `fine ${i}`)));
    lanes = lanes.add((await laneState(gateway, 'primary'))?.health ?? 'healthy');
    await sleep(100);
  }
  await until(poisonFailed, 'the poison request to fail', 10_000);
  const failed = (await requestRows(gateway, [poison!]))[0];
  t.match(failed, { charged_attempts: 5, last_error_code: 'upstream_server_error' }, 'failed once 5 attempts were charged');
  // (an attempt with no success on the lane since the one before is not charged)
  t.ok(failed.attempts >= 5 && failed.attempts <= 7, `in ${failed.attempts} attempts`);
  await until(allCompleted(gateway, healthy), 'the others to complete');
  t.same([...lanes], ['healthy'], 'the lane never opened');
  t.notOk(gateway.logs.some((line) => line.includes('lane health changed')));
});

t.test('two failures of a healthy lane recorded at once, by two statements, charge one request, as one after the other would', async (t) => {
  // The first two calls are held, each until the test answers it 500; later calls (the retries) hang.
  const answers: ((reply: { status: number }) => void)[] = [];
  const upstream = await startFakeUpstream(t, (call) =>
    call.count <= 2 ? new Promise((resolve) => (answers[call.count - 1] = resolve)) : { hang: true },
  );
  const file = await upstreamsFile(t, [{ name: 'primary', base_url: upstream.baseUrl, models: ['gpt-test'] }]);
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: file, MAX_ATTEMPTS: '5', UPSTREAM_TIMEOUT_MS: '60000' } });
  const key = await gateway.createKey({ mode: 'live' });
  const ids = await submit(gateway, key, 'gpt-test', 2, 'brownout');
  await until(() => answers.length === 2 && answers.every(Boolean), 'both calls to reach the provider');

  // The lane's row, locked here: each failure's recording waits for it, in a statement of its
  // own (the first is under way when the second ends), both begun while the lane had no failure.
  const locker = await gateway.pool.connect();
  t.teardown(() => locker.release());
  await locker.query('begin');
  await locker.query(`select from gateway.lanes where upstream = 'primary' for update`);
  answers[0]!({ status: 500 });
  await until(async () => (await waitingOnLock(gateway.pool, 'gateway-worker')) === 1, 'the first failure\'s recording to wait for the lane');
  answers[1]!({ status: 500 });
  await until(async () => (await waitingOnLock(gateway.pool, 'gateway-worker')) === 2, 'the second\'s to wait too');
  await locker.query('commit');

  const firstAttempts = async () =>
    (await gateway.pool.query<{ charged: boolean | null }>(
      `select charged from gateway.request_attempts where request_id = any($1) and attempt_number = 1 and outcome <> 'running'`,
      [ids],
    )).rows;
  await until(async () => (await firstAttempts()).length === 2, 'both failures to be recorded');
  const charged = (await firstAttempts()).filter((attempt) => attempt.charged).length;
  t.equal(charged, 1, 'one of the two failures is charged: the second is recorded after the first, which the lane\'s state says');
  t.match(await laneState(gateway, 'primary'), { health: 'healthy' }, 'the lane stays healthy');
});
