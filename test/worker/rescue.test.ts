// The rescues (worker/rescue.ts): a queue with requests due and nothing to dispatch it is
// dispatched, and an endpoint with webhook messages due and nothing to deliver them is woken, and
// no other; and a worker does both on its own, so that a request whose wake-up was lost still
// runs, and a message whose wake-up was lost is still delivered. A message left pending on a
// disabled endpoint (a probe's claim raced the 410 that disabled it) is abandoned.
import { Writable } from 'node:stream';
import t from 'tap';
import { createDb, createPool } from '../../src/db/pool.ts';
import { createLogger } from '../../src/logger.ts';
import { Metrics } from '../../src/metrics.ts';
import { ENDPOINT_BACKOFF } from '../../src/webhooks/deliverer.ts';
import { claimMessage, finishTry } from '../../src/webhooks/delivery-repository.ts';
import { oldestUnfinishedMessageAge } from '../../src/webhooks/repository.ts';
import { rescueStranded } from '../../src/worker/rescue.ts';
import { abandonOnDisabledEndpoints, dispatchStranded, wakeStrandedEndpoints } from '../../src/worker/rescue-repository.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { send } from '../helpers/http.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { dispatchJobs, isTerminal, waitForRow, waitingOnLock } from '../helpers/rows.ts';
import { until } from '../helpers/wait.ts';
import {
  addTestEndpoint,
  deliveryJobs,
  endRequest,
  messagesOf,
  takeDueWebhookJobs,
  testDeliverer,
  triesOf,
  wakeJobs,
} from '../webhooks/support.ts';
import { accept, eventForReceiver, loseJobs, WEBHOOK_TASKS } from './support.ts';

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

  // The disabled endpoint's message, pending: abandoned, once the endpoint has been disabled that long.
  t.same(await abandonOnDisabledEndpoints(gateway.db, 5_000, 100), [], 'not an endpoint disabled a moment ago');
  await gateway.pool.query(`update gateway.webhook_endpoints set disabled_at = now() - interval '10 seconds' where id = $1`, [disabled!.id]);
  t.same(await abandonOnDisabledEndpoints(gateway.db, 5_000, 100), [{ endpoint_id: disabled!.id, messages: 1 }], 'its message abandoned, and no other');
  const messages = await messagesOf(gateway.db);
  t.match(messages.filter((message) => message.endpoint_id === disabled!.id), [{ status: 'abandoned', next_try_at: null }]);
  t.same(messages.filter((message) => message.endpoint_id !== disabled!.id).map((message) => message.status), Array(5).fill('pending'), 'the others still pending');
  t.same(await abandonOnDisabledEndpoints(gateway.db, 5_000, 100), [], 'nothing left to abandon');
});

t.test('a worker delivers a message whose wake-up was lost', async (t) => {
  const { api, receiver, endpoint, requestId } = await eventForReceiver(t);
  await loseJobs(api, WEBHOOK_TASKS);

  const worker = await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env: { WORKER_DEAD_AFTER_MS: '1000', METRICS_PORT: '0', WEBHOOK_ALLOW_PRIVATE: 'true' } });
  await until(() => receiver.deliveries.length === 1, 'the message to be delivered', 10_000);
  t.equal(receiver.deliveries[0]!.event?.data.id, requestId, 'its event delivered, and verified');
  const metrics = parseMetrics((await send(worker.metricsUrl, { path: '/metrics' })).text);
  t.equal(metrics.get('gateway_webhook_endpoints_rescued_total'), 1, 'counted');
  const logged = worker.logs.map((line) => JSON.parse(line)).filter((line) => line.component === 'rescue');
  t.match(logged, [{ level: 'info', msg: 'webhook endpoints with messages due and nothing to deliver them: woken', endpointIds: [endpoint.id] }], 'and logged');
});

t.test("a message a probe's claim leaves pending while a 410 disables its endpoint is abandoned by the rescue", async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const endpoint = await addTestEndpoint(gateway, { url: 'http://127.0.0.1:9/hooks' });
  const named = (applicationName: string) => {
    const pool = createPool(gateway.databaseUrl, { max: 1, applicationName, logger: createLogger({ logLevel: 'silent' }) });
    t.teardown(() => pool.end());
    return createDb(pool);
  };
  const finisher = named('gone-race-finisher');
  const { deliverer } = testDeliverer(t, { db: named('gone-race-claimer'), config: gateway.config });

  // A try in flight, begun before its endpoint backed off (others timed out since); the wait is
  // over, so the next claim is the endpoint's probe.
  const first = await endRequest(gateway, key, 'completed');
  const [gone] = await messagesOf(gateway.db, first);
  await takeDueWebhookJobs(gateway.db);
  t.match(await claimMessage(gateway.db, gone!.id, 'worker-gone', 1_000), { kind: 'claimed' });
  await gateway.pool.query(
    `update gateway.webhook_endpoints set backoff_ms = 1000, timed_out_at = now() - interval '5 seconds', paused_until = now() - interval '1 second' where id = $1`,
    [endpoint.id],
  );

  // The try's receiver answers 410; its end waits for the endpoint's row, held by the test.
  const locker = await gateway.pool.connect();
  t.teardown(() => locker.release());
  await locker.query('begin');
  await locker.query('select from gateway.webhook_endpoints where id = $1 for no key update', [endpoint.id]);
  const end = finishTry(finisher, {
    messageId: gone!.id, endpointId: endpoint.id, tryNumber: 1, kind: 'gone', httpStatus: 410,
    error: 'HTTP 410 Gone: the endpoint is disabled', durationMs: 5, timedOut: false,
  }, ENDPOINT_BACKOFF);
  await until(async () => (await waitingOnLock(gateway.pool, 'gone-race-finisher')) === 1, "the 410's end to wait for the endpoint");

  // Meanwhile a request ends (its message written after the 410's statement began), and its job's
  // claim, the endpoint's probe, waits for the endpoint's row too.
  const second = await endRequest(gateway, key, 'completed');
  const [message] = await messagesOf(gateway.db, second);
  t.match(await takeDueWebhookJobs(gateway.db), [{ task: 'deliver_webhook', message_id: message!.id }]);
  const delivery = deliverer.deliver(message!.id, endpoint.id);
  await until(async () => (await waitingOnLock(gateway.pool, 'gone-race-claimer')) === 1, 'the probe to wait for the endpoint');
  await locker.query('commit');

  t.equal(await end, 'abandoned', 'the 410 is recorded');
  t.equal(await delivery, 'deferred', 'the probe lost its endpoint to the 410: not claimed');
  const { rows } = await gateway.pool.query('select disabled_at from gateway.webhook_endpoints where id = $1', [endpoint.id]);
  t.ok(rows[0].disabled_at, 'the endpoint is disabled');
  t.match(await messagesOf(gateway.db, second), [{ status: 'pending', tries: 0 }], 'the message is left pending');
  t.same(await wakeJobs(gateway.db), [], 'with no wake');
  t.same(await deliveryJobs(gateway.db), [], 'nor a job of its own');

  const logs: Record<string, any>[] = [];
  const sink = new Writable({
    write(chunk: Buffer, _encoding, done) {
      for (const line of chunk.toString('utf8').split('\n').filter(Boolean)) logs.push(JSON.parse(line));
      done();
    },
  });
  const metrics = new Metrics();
  await rescueStranded({ db: gateway.db, metrics, logger: createLogger({ logLevel: 'info' }, sink) }, 0);
  const [rescued] = await messagesOf(gateway.db, second);
  t.match(rescued, { status: 'abandoned', tries: 0, next_try_at: null }, 'the rescue abandons it, as the 410 would have');
  t.ok(rescued!.finished_at, 'finished');
  t.same(await triesOf(gateway.db, message!.id), [], 'nothing sent');
  t.match(logs.filter((line) => line.component === 'rescue'), [
    { level: 'info', msg: 'webhook messages pending on disabled endpoints: abandoned', endpointIds: [endpoint.id], messages: 1 },
  ], 'and logged');
  t.equal(await oldestUnfinishedMessageAge(gateway.db), 0, 'no event is left unfinished');
});
