// The rescues (worker/rescue.ts): a queue with requests due and nothing to dispatch it is
// dispatched, and an endpoint with webhook messages due and nothing to deliver them is woken, and
// no other; and a worker does both on its own, so that a request whose wake-up was lost still
// runs, and a message whose wake-up was lost is still delivered.
import t from 'tap';
import { dispatchStranded, wakeStrandedEndpoints } from '../../src/worker/rescue-repository.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { send } from '../helpers/http.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { dispatchJobs, isTerminal, waitForRow } from '../helpers/rows.ts';
import { until } from '../helpers/wait.ts';
import { addTestEndpoint, endRequest, startReceiver, wakeJobs } from '../webhooks/support.ts';
import { accept, loseJobs, WEBHOOK_TASKS } from './support.ts';

t.test('a queue with a request due and nothing to dispatch it is dispatched, and no other', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey({ mode: 'live' });
  const stranded = await accept(gateway, key, 'stranded');
  const scheduled = await accept(gateway, key, 'scheduled');
  const claimed = await accept(gateway, key, 'claimed');
  const probing = await accept(gateway, key, 'probing');
  const capped = await accept(gateway, key, 'capped');
  const young = await accept(gateway, key, 'young');
  await loseJobs(gateway);
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
  await loseJobs(gateway);
  await gateway.pool.query(`select graphile_worker.add_job('dispatch_queue', json_build_object('queue_id', $1::bigint), run_at => now() + interval '1 hour')`, [scheduled.queueId]);

  t.same(await dispatchStranded(gateway.db, 5_000, 100), [{ id: stranded.queueId, mode: 'live' }], 'only the stranded queue');
  const jobs = await dispatchJobs(gateway.db);
  t.same(jobs.map((job) => job.queue_id).sort(), [scheduled.queueId, stranded.queueId].sort(), 'one dispatch job added, for it');
  t.ok(jobs.find((job) => job.queue_id === stranded.queueId)!.run_at.getTime() <= Date.now() + 1_000, 'due now');
  t.same(await dispatchStranded(gateway.db, 5_000, 100), [], 'once dispatched, it has a job: not rescued again');

  // Once the call in flight on the capped lane has ended, nothing will dispatch its queue.
  await gateway.pool.query(`update gateway.requests set status = 'queued', lane_id = null where id = $1`, [call.id]);
  // Batches of one: the due queues with jobs, before it in id order, do not fill the batch.
  t.same(await dispatchStranded(gateway.db, 5_000, 1), [{ id: capped.queueId, mode: 'live' }], 'the capped queue, its call ended, though queues with jobs come before it');
});

t.test('a worker dispatches a queue whose wake-up was lost', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const key = await api.createKey();
  const { id, queueId } = await accept(api, key, 'test-echo');
  await loseJobs(api);

  const worker = await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env: { WORKER_DEAD_AFTER_MS: '1000', METRICS_PORT: '0' } });
  const row = await waitForRow(api.db, id, isTerminal);
  t.equal(row.status, 'completed', 'the request ran');
  const metrics = parseMetrics((await send(worker.metricsUrl, { path: '/metrics' })).text);
  t.equal(metrics.get('gateway_queues_rescued_total{mode="test"}'), 1, 'counted');
  const logged = worker.logs.map((line) => JSON.parse(line)).filter((line) => line.component === 'rescue');
  t.match(logged, [{ level: 'info', msg: 'queues with requests due and nothing to dispatch them: dispatched', queueIds: [queueId] }], 'and logged');
});

t.test('an endpoint with a message due and nothing to deliver it is woken, and no other', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const url = 'http://127.0.0.1:9/hooks';
  const [stranded, woken, disabled, backingOff, delivering, later] = await Promise.all(
    Array.from({ length: 6 }, () => addTestEndpoint(gateway, { url })),
  );
  // One message for each endpoint, due for 10 s, with none of its jobs.
  await endRequest(gateway, key, 'completed');
  await loseJobs(gateway, WEBHOOK_TASKS);
  await gateway.pool.query(`update gateway.webhook_messages set next_try_at = now() - interval '10 seconds'`);

  // A wake due in an hour; disabled (a 410); backing off for an hour; a try due now; a try due in an hour.
  await gateway.pool.query(`select graphile_worker.add_job('wake_webhook_endpoint', json_build_object('endpoint_id', $1::text, 'deferrals', 1), run_at => now() + interval '1 hour', job_key => 'wake_webhook_endpoint:' || $1)`, [woken!.id]);
  await gateway.pool.query(`update gateway.webhook_endpoints set disabled_at = now() where id = $1`, [disabled!.id]);
  await gateway.pool.query(`update gateway.webhook_endpoints set backoff_ms = 1000, timed_out_at = now(), paused_until = now() + interval '1 hour' where id = $1`, [backingOff!.id]);
  for (const [endpoint, runAt] of [[delivering!, 'now()'], [later!, `now() + interval '1 hour'`]] as const) {
    await gateway.pool.query(
      `select graphile_worker.add_job('deliver_webhook', json_build_object('message_id', id, 'endpoint_id', endpoint_id), run_at => ${runAt})
       from gateway.webhook_messages where endpoint_id = $1`,
      [endpoint.id],
    );
  }

  // Batches of one: the endpoints due with a job, whichever come first in id order, do not fill a batch.
  const batches = [await wakeStrandedEndpoints(gateway.db, 5_000, 1), await wakeStrandedEndpoints(gateway.db, 5_000, 1)];
  t.same(batches.map((batch) => batch.length), [1, 1], 'one endpoint in each batch of one');
  t.same(batches.flat().sort(), [stranded!.id, later!.id].sort(), 'the stranded endpoint, and the one whose only try is due later');
  const wakes = await wakeJobs(gateway.db);
  for (const endpoint of [stranded!, later!]) {
    t.match(wakes.filter((wake) => wake.endpoint_id === endpoint.id), [{ deferrals: 0, key: `wake_webhook_endpoint:${endpoint.id}` }], 'its wake job added');
  }
  t.same(await wakeStrandedEndpoints(gateway.db, 5_000, 100), [], 'once woken, it has a job: not rescued again');
});

t.test('a worker delivers a message whose wake-up was lost', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const receiver = await startReceiver(t);
  const endpoint = await addTestEndpoint(api, { url: receiver.url });
  receiver.secrets.push(endpoint.secret);
  const requestId = await endRequest(api, await api.createKey(), 'completed');
  await loseJobs(api, WEBHOOK_TASKS);

  const worker = await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env: { WORKER_DEAD_AFTER_MS: '1000', METRICS_PORT: '0', WEBHOOK_ALLOW_PRIVATE: 'true' } });
  await until(() => receiver.deliveries.length === 1, 'the message to be delivered', 10_000);
  t.equal(receiver.deliveries[0]!.event?.data.id, requestId, 'its event delivered, and verified');
  const metrics = parseMetrics((await send(worker.metricsUrl, { path: '/metrics' })).text);
  t.equal(metrics.get('gateway_webhook_endpoints_rescued_total'), 1, 'counted');
  const logged = worker.logs.map((line) => JSON.parse(line)).filter((line) => line.component === 'rescue');
  t.match(logged, [{ level: 'info', msg: 'webhook endpoints with messages due and nothing to deliver them: woken', endpointIds: [endpoint.id] }], 'and logged');
});
