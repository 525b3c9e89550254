// The rescue of stranded queues (worker/rescue.ts): a queue with requests due and nothing to
// dispatch it is dispatched, and no other; and a worker does it on its own, so that a request
// whose wake-up was lost still runs.
import t from 'tap';
import { dispatchStranded } from '../../src/worker/rescue-repository.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { dispatchJobs, isTerminal, queueOf, waitForRow } from '../helpers/rows.ts';

/** Accepts one request of `model` (no worker runs it); returns its id and its queue's. */
async function accept(gateway: TestGateway, key: Awaited<ReturnType<TestGateway['createKey']>>, model: string) {
  const answer = await clientFor(gateway.url, key).post({ model, messages: userMessage() });
  const id = (answer.body as { id: string }).id;
  return { id, queueId: await queueOf(gateway.db, id) };
}

/** Forgets every dispatch job: the wake-ups of the requests are lost. */
async function loseDispatchJobs(gateway: TestGateway): Promise<void> {
  await gateway.pool.query(`
    delete from graphile_worker._private_jobs
    where task_id = (select id from graphile_worker._private_tasks where identifier = 'dispatch_queue')`);
}

t.test('a queue with a request due and nothing to dispatch it is dispatched, and no other', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey({ mode: 'live' });
  const stranded = await accept(gateway, key, 'stranded');
  const scheduled = await accept(gateway, key, 'scheduled');
  const claimed = await accept(gateway, key, 'claimed');
  const probing = await accept(gateway, key, 'probing');
  const capped = await accept(gateway, key, 'capped');
  const young = await accept(gateway, key, 'young');
  await loseDispatchJobs(gateway);
  // Every request but the young one has been due for 10 s.
  await gateway.pool.query(`update gateway.requests set next_attempt_at = now() - interval '10 seconds' where id <> $1`, [young.id]);

  // A dispatch due in an hour (its lane is paused, say).
  await gateway.pool.query(`select graphile_worker.add_job('dispatch_queue', json_build_object('queue_id', $1::bigint), run_at => now() + interval '1 hour')`, [scheduled.queueId]);
  // A claim a moment ago.
  await gateway.pool.query(`insert into gateway.lanes (mode, upstream, model, queue_id, refilled_at) values ('live', 'default', 'claimed', $1, now())`, [claimed.queueId]);
  // A probe in flight (a second request of the queue is its lane's probe), and a call in flight on
  // a lane with max_concurrent: their ends dispatch their queues.
  const probe = await accept(gateway, key, 'probing');
  const call = await accept(gateway, key, 'capped');
  const { rows: lanes } = await gateway.pool.query<{ id: string; model: string }>(`
    insert into gateway.lanes (mode, upstream, model, queue_id, refilled_at, health, probe_request_id, max_concurrent)
    values ('live', 'default', 'probing', $1, now() - interval '1 minute', 'probing', $3, null),
           ('live', 'default', 'capped', $2, now() - interval '1 minute', 'healthy', null, 1)
    returning id::text, model`, [probing.queueId, capped.queueId, probe.id]);
  for (const { id, model } of lanes) {
    await gateway.pool.query(`update gateway.requests set status = 'processing', lane_id = $1 where id = $2`, [id, model === 'probing' ? probe.id : call.id]);
  }
  await loseDispatchJobs(gateway);
  await gateway.pool.query(`select graphile_worker.add_job('dispatch_queue', json_build_object('queue_id', $1::bigint), run_at => now() + interval '1 hour')`, [scheduled.queueId]);

  t.same(await dispatchStranded(gateway.db, 5_000, 100), [{ id: stranded.queueId, mode: 'live' }], 'only the stranded queue');
  const jobs = await dispatchJobs(gateway.db);
  t.same(jobs.map((job) => job.queue_id).sort(), [scheduled.queueId, stranded.queueId].sort(), 'one dispatch job added, for it');
  t.ok(jobs.find((job) => job.queue_id === stranded.queueId)!.run_at.getTime() <= Date.now() + 1_000, 'due now');
  t.same(await dispatchStranded(gateway.db, 5_000, 100), [], 'once dispatched, it has a job: not rescued again');

  // Once the call in flight on the capped lane has ended, nothing will dispatch its queue.
  await gateway.pool.query(`update gateway.requests set status = 'queued', lane_id = null where id = $1`, [call.id]);
  t.same(await dispatchStranded(gateway.db, 5_000, 100), [{ id: capped.queueId, mode: 'live' }], 'the capped queue, its call ended');
});

t.test('a worker dispatches a queue whose wake-up was lost', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const key = await api.createKey();
  const { id, queueId } = await accept(api, key, 'test-echo');
  await loseDispatchJobs(api);

  const worker = await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env: { WORKER_DEAD_AFTER_MS: '1000', METRICS_PORT: '0' } });
  const row = await waitForRow(api.db, id, isTerminal);
  t.equal(row.status, 'completed', 'the request ran');
  const metrics = parseMetrics((await send(worker.metricsUrl, { path: '/metrics' })).text);
  t.equal(metrics.get('gateway_queues_rescued_total{mode="test"}'), 1, 'counted');
  const logged = worker.logs.map((line) => JSON.parse(line)).filter((line) => line.component === 'rescue');
  t.match(logged, [{ level: 'info', msg: 'queues with requests due and nothing to dispatch them: dispatched', queueIds: [queueId] }], 'and logged');
});
