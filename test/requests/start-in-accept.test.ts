// A wait=true request accepted by a process that also runs a worker has its first attempt
// started by the accept's own statement, when a claim of its queue would start it and nothing
// else; otherwise it is stored queued, and claimed as any other (requests/insert-repository.ts).
import { createHash } from 'node:crypto';
import { sql } from 'kysely';
import t from 'tap';
import { newRequestId } from '../../src/ids.ts';
import { ensureLanes, ensureQueue } from '../../src/lanes/repository.ts';
import { insertRequests, type NewRequest } from '../../src/requests/insert-repository.ts';
import { SIMULATOR } from '../../src/upstream/upstreams.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { completionAfter, completionFor, startFakeUpstream } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';
import { upstreamsFile } from '../helpers/upstreams-file.ts';
import { attemptRows, dispatchJobs, isTerminal, requestRow, waitForRow } from '../helpers/rows.ts';
import type { Db } from '../../src/db/pool.ts';

/** The request whose one message is `content` (a wait=true answer carries no request id). */
async function requestOf(db: Db, content: string) {
  const { rows } = await sql<{ id: string }>`
    select id from gateway.requests where body->'messages'->0->>'content' = ${content}
  `.execute(db);
  return (await requestRow(db, rows[0]!.id))!;
}

t.test('through the API: once the queue is known to the process, its wait=true requests start in their accept', async (t) => {
  const gateway = await startTestGateway(t, { role: 'all' });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'test' }));
  const ask = async (content: string) => {
    const { status, body } = await client.post({ model: 'test-echo', messages: userMessage(content), wait: true });
    t.equal(status, 200, `"${content}" is answered with its completion`);
    t.equal(body.choices[0].message.content, content);
    const request = await requestOf(gateway.db, content);
    const [attempt] = await attemptRows(gateway.db, request.id);
    t.equal(request.status, 'completed');
    return { request, attempt: attempt! };
  };

  // The process learns the queue's route on its first dispatch: the first request is claimed.
  const first = await ask('first');
  t.ok(first.attempt.started_at > first.request.created_at, 'the first request was started by a claim, after its accept had committed');
  for (const content of ['second', 'third']) {
    const { request, attempt } = await ask(content);
    t.equal(attempt.started_at.getTime(), request.created_at.getTime(), `"${content}" was started in its accept's transaction`);
    t.equal(attempt.worker_id, first.attempt.worker_id, 'by the worker of the process that accepted it');
    t.equal(attempt.upstream, SIMULATOR, 'on the lane a claim would have chosen');
    t.equal(attempt.outcome, 'succeeded');
    t.equal(request.lane_id, first.request.lane_id);
  }

  const { body } = await client.post({ model: 'test-echo', messages: userMessage('no wait') });
  const id = body.id as string;
  t.equal(body.status, 'queued', 'a wait=false request is acknowledged queued, as before');
  const request = await waitForRow(gateway.db, id, isTerminal);
  const [attempt] = await attemptRows(gateway.db, id);
  t.equal(request.status, 'completed');
  t.ok(attempt!.started_at > request.created_at, 'and is claimed after its accept');
});

t.test('a request started in its accept is cancelled as any other: its call aborted, its waiting client answered', async (t) => {
  // The first call is answered (the process learns the queue's route with it); the next hangs.
  const upstream = await startFakeUpstream(t, (call) => (call.count === 1 ? { status: 200, json: completionFor(call.body) } : { hang: true }));
  const gateway = await startTestGateway(t, { role: 'all', env: { UPSTREAM_BASE_URL: upstream.baseUrl, WAIT_TIMEOUT_MS: '20000' } });
  const key = await gateway.createKey({ mode: 'live' });
  const client = clientFor(gateway.url, key);
  t.equal((await client.post({ model: 'gpt-x', messages: userMessage('first'), wait: true })).status, 200);

  const waiting = client.post({ model: 'gpt-x', messages: userMessage('second'), wait: true });
  await until(() => upstream.calls.length === 2, 'the second call to reach the upstream', 10_000);
  const request = await requestOf(gateway.db, 'second');
  const { id } = request;
  const [attempt] = await attemptRows(gateway.db, id);
  t.equal(attempt!.started_at.getTime(), request.created_at.getTime(), 'it was started in its accept');

  const cancelled = await send(gateway.url, { method: 'POST', path: `/v1/requests/${id}/cancel`, key });
  t.match(cancelled, { status: 200, body: { status: 'cancelled', attempts: 1 } });
  const acknowledged = await waiting;
  t.match(acknowledged, { status: 202, body: { id, status: 'cancelled' } }, 'the waiting client is answered');
  const call = upstream.calls[1]!;
  await until(() => call.endedAt !== undefined, 'the upstream connection to close', 5_000);
  await until(async () => (await attemptRows(gateway.db, id))[0]?.outcome === 'cancelled', 'the attempt to be recorded as cancelled', 5_000);
  t.equal(upstream.calls.length, 2, 'no retry');
});

t.test("a lane with max_concurrent: its requests are claimed, and the limit holds", async (t) => {
  const upstream = await startFakeUpstream(t, completionAfter(300), { limits: { maxConcurrent: 1 } });
  const file = await upstreamsFile(t, [
    { name: 'limited', base_url: upstream.baseUrl, models: ['limited-model'], limits: { max_concurrent: 1 } },
  ]);
  const gateway = await startTestGateway(t, { role: 'all', env: { UPSTREAMS_FILE: file, UPSTREAM_TIMEOUT_MS: '5000' } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const ask = (content: string) => client.post({ model: 'limited-model', messages: userMessage(content), wait: true });

  t.equal((await ask('first')).status, 200, 'the first request makes the queue known to the process');
  const answers = await Promise.all(['a', 'b', 'c'].map((content) => ask(content)));
  t.same(answers.map((answer) => answer.status), [200, 200, 200], 'then three at once are answered');
  t.equal(upstream.peakInFlight(), 1, 'one call at a time reached the upstream');
  t.equal(upstream.refused.concurrency, 0, 'and none over its limit');
  const { rows } = await sql<{ started_in_accept: boolean }>`
    select attempts.started_at = requests.created_at as started_in_accept
    from gateway.requests join gateway.request_attempts as attempts on attempts.request_id = requests.id
  `.execute(gateway.db);
  t.same(rows.filter((row) => row.started_in_accept), [], 'every attempt was started by a claim');
});

t.test('the accept starts the attempt only where a claim would start that request and nothing else', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  await gateway.stop();
  const key = await gateway.createKey({ mode: 'test' });
  const project = (await gateway.db.selectFrom('api_keys').select('project_id').where('id', '=', key.id).executeTakeFirstOrThrow()).project_id;
  const workerId = 'worker-start-in-accept';

  const queueOf = async (model: string) => {
    const queueId = await ensureQueue(gateway.db, { mode: 'test', model });
    const [laneId] = await ensureLanes(gateway.db, { id: queueId, mode: 'test', model }, [SIMULATOR]);
    return { queueId, laneId: laneId! };
  };
  const request = (queue: { queueId: string; laneId: string }, start = true, content = 'hi'): NewRequest => {
    const body = JSON.stringify({ model: 'm', messages: userMessage(content) });
    return {
      id: newRequestId(),
      project_id: project,
      mode: 'test',
      api_key_id: key.id,
      model: 'm',
      body,
      body_sha256: createHash('sha256').update(body).digest(),
      idempotency_key: null,
      queue_id: queue.queueId,
      prompt_tokens_estimate: null,
      deadline_ms: 60_000,
      start: start ? { laneId: queue.laneId, workerId } : undefined,
    };
  };
  const insert = async (...requests: NewRequest[]) => {
    const { results } = await insertRequests(gateway.db, requests.map((request) => ({ request, nonce: undefined })));
    return results.map((result) => (result.kind === 'inserted' ? result.answer.status : result.kind));
  };
  const jobsOf = async (queueId: string) => (await dispatchJobs(gateway.db)).filter((job) => job.queue_id === queueId).length;

  await t.test('an idle queue on a healthy lane: started, with its attempt, and no dispatch job', async (t) => {
    const queue = await queueOf('start-idle');
    const [a, b] = [request(queue), request(queue)];
    t.same(await insert(a, b), ['processing', 'processing'], 'both requests of the statement start');
    for (const id of [a.id, b.id]) {
      const row = (await requestRow(gateway.db, id))!;
      t.match(row, { status: 'processing', attempts: 1, lane_id: queue.laneId, next_attempt_at: null });
      const attempts = await attemptRows(gateway.db, id);
      t.match(attempts, [{ attempt_number: 1, worker_id: workerId, upstream: SIMULATOR, outcome: 'running' }]);
    }
    t.equal(await jobsOf(queue.queueId), 0, 'nothing wakes the queue');
  });

  await t.test('without a start, or with the lane of another queue: queued, and its queue woken', async (t) => {
    const queue = await queueOf('start-none');
    const other = await queueOf('start-other');
    t.same(await insert(request(queue, false), request({ queueId: queue.queueId, laneId: other.laneId })), ['queued', 'queued']);
    t.equal(await jobsOf(queue.queueId), 1);
  });

  await t.test('a paused lane, or one that is not healthy: queued', async (t) => {
    const paused = await queueOf('start-paused');
    await sql`update gateway.lanes set paused_until = now() + interval '1 hour' where id = ${paused.laneId}`.execute(gateway.db);
    const open = await queueOf('start-open');
    await sql`update gateway.lanes set health = 'open', probe_at = now() + interval '1 hour' where id = ${open.laneId}`.execute(gateway.db);
    const [onPaused, onOpen] = [request(paused), request(open)];
    t.same(await insert(onPaused, onOpen), ['queued', 'queued']);
    t.same(await attemptRows(gateway.db, onPaused.id), [], 'no attempt on the paused lane');
    t.same(await attemptRows(gateway.db, onOpen.id), [], 'nor on the open one');
  });

  await t.test('requests of the queue are due: the new one waits its turn behind them', async (t) => {
    const queue = await queueOf('start-behind');
    t.same(await insert(request(queue, false, 'waiting')), ['queued']);
    t.same(await insert(request(queue)), ['queued'], 'not started ahead of the one waiting');
    // Retrying requests due later hold nothing up.
    const later = await queueOf('start-later');
    t.same(await insert(request(later, false, 'later')), ['queued']);
    await sql`update gateway.requests set status = 'retrying', next_attempt_at = now() + interval '1 hour' where queue_id = ${later.queueId}`.execute(gateway.db);
    t.same(await insert(request(later)), ['processing'], 'a retry due later does not hold the new one back');
  });
});
