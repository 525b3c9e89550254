// The lifecycle of docs/api.md ("Statuses and lifecycle"), observed state by state: queued ->
// processing -> retrying -> processing -> completed, processing -> failed; a lost attempt is
// recorded as worker_lost and retried; a terminal request is never run again; concurrent
// dispatches of a queue start each request once.
import t, { type Test } from 'tap';
import type { Db } from '../../src/db/pool.ts';
import { LANE_HEALTH } from '../../src/lanes/health.ts';
import { finishAttempts } from '../../src/worker/attempts-repository.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { attemptRows, claimQueueOf, dispatchJobs, isTerminal, requestRow, waitForRow } from '../helpers/rows.ts';
import { completionFor, startFakeUpstream, type Reply } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';

const NO_USAGE = { prompt: null, completion: null, total: null };

/** Starts the request's next attempt as a worker that then dies: no heartbeat row, nothing recorded. */
async function claimAsDeadWorker(api: { db: Db }, id: string) {
  const claim = await claimQueueOf(api.db, id, 10, 'worker-that-died');
  if (!claim.started.some((started) => started.id === id)) throw new Error('not claimed');
}

/** An upstream whose every answer the test gives by hand. */
async function gatedUpstream(t: Test) {
  const pending: ((reply: Reply) => void)[] = [];
  const upstream = await startFakeUpstream(t, () => new Promise<Reply>((resolve) => pending.push(resolve)));
  return {
    ...upstream,
    async answer(reply: Reply) {
      while (pending.length === 0) await new Promise((resolve) => setTimeout(resolve, 10));
      pending.shift()!(reply);
    },
  };
}

/** A live request accepted by an API with no worker: it stays queued until the test starts one. */
async function acceptWithoutWorker(t: Test, env: Record<string, string>) {
  const api = await startTestGateway(t, { role: 'api', env });
  const accepted = await clientFor(api.url, await api.createKey({ mode: 'live' })).post({
    model: 'gpt-test',
    messages: userMessage(),
  });
  return { api, id: accepted.body.id as string };
}

t.test('queued -> processing -> retrying -> processing -> completed', async (t) => {
  const upstream = await gatedUpstream(t);
  const env = { UPSTREAM_BASE_URL: upstream.baseUrl };
  const { api, id } = await acceptWithoutWorker(t, env);
  t.match(await requestRow(api.db, id), { status: 'queued', attempts: 0 }, 'queued');

  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env });
  t.match(await waitForRow(api.db, id, (row) => row.status === 'processing'), { attempts: 1 }, 'processing');
  t.match(await attemptRows(api.db, id), [{ attempt_number: 1, outcome: 'running', finished_at: null }]);

  await upstream.answer({ status: 429, headers: { 'retry-after': '2' } });
  const retrying = await waitForRow(api.db, id, (row) => row.status === 'retrying');
  t.match(retrying, { attempts: 1, last_error_code: 'upstream_rate_limited' }, 'retrying');
  t.ok(retrying.next_attempt_at && retrying.next_attempt_at > new Date(), 'with the next attempt due later');
  t.ok(
    (await dispatchJobs(api.db)).some((job) => job.queue_id === retrying.queue_id && job.run_at >= retrying.next_attempt_at!),
    'and a dispatch of its queue due then',
  );

  t.match(await waitForRow(api.db, id, (row) => row.status === 'processing' && row.attempts === 2), {
    next_attempt_at: null,
  }, 'processing again');
  await upstream.answer({ status: 200, json: completionFor({ messages: [{ content: 'x' }] }) });
  const completed = await waitForRow(api.db, id, isTerminal);
  t.match(completed, { status: 'completed', attempts: 2, last_error_code: 'upstream_rate_limited' }, 'completed');
  t.match(await attemptRows(api.db, id), [{ outcome: 'failed' }, { outcome: 'succeeded' }], 'no attempt left running');
});

t.test('processing -> failed', async (t) => {
  const upstream = await gatedUpstream(t);
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl } });
  const accepted = await clientFor(gateway.url, await gateway.createKey({ mode: 'live' })).post({
    model: 'gpt-test',
    messages: userMessage(),
  });
  await waitForRow(gateway.db, accepted.body.id, (row) => row.status === 'processing');
  await upstream.answer({ status: 400 });
  t.match(await waitForRow(gateway.db, accepted.body.id, isTerminal), {
    status: 'failed',
    attempts: 1,
    last_error_code: 'upstream_bad_request',
  });
});

t.test('a terminal request is never run again, whatever jobs wake its queue', async (t) => {
  const upstream = await startFakeUpstream(t);
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const accepted = await client.post({ model: 'gpt-test', messages: userMessage(), wait: true });
  t.equal(accepted.status, 200);
  const { rows } = await gateway.pool.query('select id, lane_id, queue_id from gateway.requests');
  const id = rows[0].id as string;
  const before = await requestRow(gateway.db, id);

  // Stray dispatches of its queue, and jobs of earlier versions naming its lane or the request.
  for (let i = 0; i < 3; i++) {
    await gateway.pool.query(`select graphile_worker.add_job('dispatch_queue', json_build_object('queue_id', $1::bigint))`, [rows[0].queue_id]);
    await gateway.pool.query(`select graphile_worker.add_job('dispatch_lane', json_build_object('lane_id', $1::bigint))`, [rows[0].lane_id]);
  }
  for (const attempt of [1, 2, 5]) {
    await gateway.pool.query(
      `select graphile_worker.add_job('process_request', json_build_object('request_id', $1::text, 'attempt', $2::int))`,
      [id, attempt],
    );
  }
  await until(async () => {
    const { rows: jobs } = await gateway.pool.query('select count(*)::int as count from graphile_worker.jobs');
    return jobs[0].count === 0;
  }, 'the stray jobs to be run');
  t.same(await requestRow(gateway.db, id), before, 'the row did not change');
  t.equal(upstream.calls.length, 1, 'the upstream was called once');
  t.equal((await attemptRows(gateway.db, id)).length, 1);
});

t.test('dispatches of one queue at the same time start each request once', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const client = clientFor(api.url, await api.createKey({ mode: 'live' }));
  const ids = await Promise.all(
    Array.from({ length: 50 }, async (_, i) => (await client.post({ model: 'gpt-test', messages: userMessage(`n${i}`) })).body.id as string),
  );
  const claims = await Promise.all(['a', 'b', 'c', 'd', 'e'].map((worker) => claimQueueOf(api.db, ids[0]!, 20, `worker-${worker}`)));
  const started = claims.flatMap((claim) => claim.started.map((attempt) => attempt.id));
  t.equal(started.length, 50, 'fifty attempts started');
  t.same(new Set(started), new Set(ids), 'one for each request');
  const { rows } = await api.pool.query(`select count(*)::int as count from gateway.request_attempts`);
  t.equal(rows[0].count, 50, 'and one attempt row each');
  t.ok(claims.every((claim) => claim.started.every((attempt) => attempt.attempt === 1)));
});

t.test('an attempt whose worker died is recorded as worker_lost and the request is retried', async (t) => {
  const upstream = await startFakeUpstream(t);
  const env = { UPSTREAM_BASE_URL: upstream.baseUrl, WORKER_DEAD_AFTER_MS: '1000' };
  const { api, id } = await acceptWithoutWorker(t, env);
  // A worker starts attempt 1 and dies before recording anything: its heartbeat is gone, and
  // a live worker's sweep finds the attempt.
  await claimAsDeadWorker(api, id);

  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env });
  const row = await waitForRow(api.db, id, isTerminal);
  t.match(row, { status: 'completed', attempts: 2, last_error_code: 'worker_lost' });
  t.match(await attemptRows(api.db, id), [
    { attempt_number: 1, outcome: 'failed', error_code: 'worker_lost', worker_id: 'worker-that-died' },
    { attempt_number: 2, outcome: 'succeeded', error_code: null },
  ]);
  t.equal(upstream.calls.length, 1, 'the lost attempt never reached the upstream; the retry did');

  t.notOk(
    (
      await finishAttempts(
        api.db,
        [{ kind: 'completed', id, attempt: 1, laneId: row.lane_id!, result: '{"object":"chat.completion"}', usage: NO_USAGE, upstreamStatus: 200, durationMs: 1 }],
        { maxAttempts: 5, health: LANE_HEALTH },
      )
    ).finished[0],
    'the dead worker, were it to come back, could not record its outcome',
  );
  t.same(await requestRow(api.db, id), row);
});

t.test('a lost last attempt fails the request with worker_lost', async (t) => {
  const env = { MAX_ATTEMPTS: '1', WORKER_DEAD_AFTER_MS: '1000' };
  const api = await startTestGateway(t, { role: 'api', env });
  const accepted = await clientFor(api.url, await api.createKey()).post({ model: 'test-echo', messages: userMessage() });
  await claimAsDeadWorker(api, accepted.body.id);
  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env });
  t.match(await waitForRow(api.db, accepted.body.id, isTerminal), {
    status: 'failed',
    attempts: 1,
    last_error_code: 'worker_lost',
  });
});
