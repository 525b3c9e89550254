// The lifecycle of CONTRACT.md section 1, observed state by state: queued -> processing ->
// retrying -> processing -> completed, processing -> failed; a lost attempt is recorded as
// worker_lost and retried; a terminal request is never run again.
import t, { type Test } from 'tap';
import { Metrics } from '../../src/metrics.ts';
import { createLogger } from '../../src/logger.ts';
import * as repository from '../../src/requests/repository.ts';
import { createAttempts } from '../../src/worker/process-request.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { attemptRows, isTerminal, jobsFor, requestRow, waitForNoJobs, waitForRow } from '../helpers/rows.ts';
import { completionFor, startFakeUpstream, type Reply } from '../helpers/upstream.ts';

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
  // (attempt 1's job may linger an instant: graphile-worker records job ends in batches)
  t.ok((await jobsFor(api.db, id)).some((job) => job.attempt === 2), 'and the next attempt\'s job waiting');

  t.match(await waitForRow(api.db, id, (row) => row.status === 'processing' && row.attempts === 2), {
    next_attempt_at: null,
  }, 'processing again');
  await upstream.answer({ status: 200, json: completionFor({ messages: [{ content: 'x' }] }) });
  const completed = await waitForRow(api.db, id, isTerminal);
  t.match(completed, { status: 'completed', attempts: 2, last_error_code: 'upstream_rate_limited' }, 'completed');
  await waitForNoJobs(api.db, id);
  t.pass('no job left');
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

t.test('a terminal request is never run again, whatever jobs name it', async (t) => {
  const upstream = await startFakeUpstream(t);
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const accepted = await client.post({ model: 'gpt-test', messages: userMessage(), wait: true });
  t.equal(accepted.status, 200);
  const { rows } = await gateway.pool.query('select id from gateway.requests');
  const id = rows[0].id as string;
  const before = await requestRow(gateway.db, id);

  // Stray jobs for the attempt it ran, the next one, and a far one.
  for (const attempt of [1, 2, 5]) {
    await gateway.pool.query(
      `select graphile_worker.add_job('process_request', json_build_object('request_id', $1::text, 'attempt', $2::int))`,
      [id, attempt],
    );
  }
  await waitForNoJobs(gateway.db, id);
  t.same(await requestRow(gateway.db, id), before, 'the row did not change');
  t.equal(upstream.calls.length, 1, 'the upstream was called once');
  t.equal((await attemptRows(gateway.db, id)).length, 1);
});

t.test('jobs claiming the same attempt in one group: only the first starts it', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const client = clientFor(api.url, await api.createKey({ mode: 'live' }));
  const [first, second, id] = await Promise.all(
    [1, 2, 3].map(async () => (await client.post({ model: 'gpt-test', messages: userMessage() })).body.id as string),
  );
  const attempts = createAttempts({
    db: api.db,
    config: api.config,
    metrics: new Metrics(),
    logger: createLogger({ logLevel: 'silent' }),
  });
  // Submitted in the same tick: the first two claims take the two statements allowed at once,
  // and the three claims of the last request wait for the next, together.
  const claims = [
    { id: first!, workerId: 'pool-a' },
    { id: second!, workerId: 'pool-a' },
    { id: id!, workerId: 'pool-a' },
    { id: id!, workerId: 'pool-b' },
    { id: id!, workerId: 'pool-c' },
  ];
  const claimed = await Promise.all(claims.map((claim) => attempts.claim({ ...claim, attempt: 1 })));
  t.equal(claimed.filter((attempt) => attempt?.id === id).length, 1, 'one claim started the attempt');
  t.match(claimed[2], { id, attempt: 1 }, 'the first of the group');
  t.match(await requestRow(api.db, id!), { status: 'processing', attempts: 1 });
  t.match(await attemptRows(api.db, id!), [{ attempt_number: 1, worker_id: 'pool-a' }]);
});

t.test('an attempt whose worker died is recorded as worker_lost and the request is retried', async (t) => {
  const upstream = await startFakeUpstream(t);
  const env = { UPSTREAM_BASE_URL: upstream.baseUrl };
  const { api, id } = await acceptWithoutWorker(t, env);
  // A worker claims attempt 1 and dies before recording anything: its job is left behind
  // (released, as the dead-worker sweep does) and runs again.
  t.ok(await repository.claimAttempt(api.db, id, 1, 'worker-that-died'));

  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env });
  const row = await waitForRow(api.db, id, isTerminal);
  t.match(row, { status: 'completed', attempts: 2, last_error_code: 'worker_lost' });
  t.match(await attemptRows(api.db, id), [
    { attempt_number: 1, outcome: 'failed', error_code: 'worker_lost', worker_id: 'worker-that-died' },
    { attempt_number: 2, outcome: 'succeeded', error_code: null },
  ]);
  t.equal(upstream.calls.length, 1, 'the lost attempt never reached the upstream; the retry did');

  t.notOk(
    (await repository.finishAttempts(api.db, [
      { kind: 'completed', id, attempt: 1, result: '{"object":"chat.completion"}', upstreamStatus: 200, durationMs: 1 },
    ]))[0],
    'the dead worker, were it to come back, could not record its outcome',
  );
  t.same(await requestRow(api.db, id), row);
});

t.test('a lost last attempt fails the request with worker_lost', async (t) => {
  const api = await startTestGateway(t, { role: 'api', env: { MAX_ATTEMPTS: '1' } });
  const accepted = await clientFor(api.url, await api.createKey()).post({ model: 'test-echo', messages: userMessage() });
  await repository.claimAttempt(api.db, accepted.body.id, 1, 'worker-that-died');
  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env: { MAX_ATTEMPTS: '1' } });
  t.match(await waitForRow(api.db, accepted.body.id, isTerminal), {
    status: 'failed',
    attempts: 1,
    last_error_code: 'worker_lost',
  });
});
