// Tries a live worker has lost track of: a claim that Postgres committed but whose answer the
// worker never got, a try whose end could not be recorded. No other worker's sweep takes the
// tries of a worker that beats, and the rescue looks only at pending messages: the worker hands
// them back itself (recoverForgotten), and a try's end that lost to a deadlock is recorded again.
import { randomBytes } from 'node:crypto';
import t from 'tap';
import { createDb, createPool } from '../../src/db/pool.ts';
import { createLogger } from '../../src/logger.ts';
import { recoverLostDeliveries } from '../../src/webhooks/delivery-repository.ts';
import { wakeStrandedEndpoints } from '../../src/worker/rescue-repository.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { startTcpProxy } from '../helpers/tcp-proxy.ts';
import { until } from '../helpers/wait.ts';
import { addTestEndpoint, deliveryJobs, endRequest, messagesOf, metricValue, startReceiver, testDeliverer, triesOf } from './support.ts';

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/** A worker id with a heartbeat row, as the supervisor keeps for a live worker. */
async function liveWorker(gateway: TestGateway): Promise<string> {
  const workerId = `worker-test-${randomBytes(4).toString('hex')}`;
  await gateway.pool.query(`insert into gateway.worker_pools (id, hostname, pid) values ($1, 'h', 1)`, [workerId]);
  return workerId;
}

/** Makes the message's try look as old as an hour. */
async function ageTry(gateway: TestGateway, messageId: string): Promise<void> {
  await gateway.pool.query(`update gateway.webhook_deliveries set started_at = now() - interval '1 hour' where message_id = $1`, [messageId]);
}

/**
 * Fails the next update of a try row that records its end with `sqlstate`, once (counted by a
 * sequence: its count is not rolled back with the statement that fails).
 */
async function failNextTryEnd(gateway: TestGateway, sqlstate: string, message: string): Promise<void> {
  await gateway.pool.query(`
    create sequence public.try_ends;
    create function public.fail_try_end_once() returns trigger language plpgsql as $$
    begin
      if new.outcome <> 'running' and nextval('public.try_ends') = 1 then
        raise exception '${message}' using errcode = '${sqlstate}';
      end if;
      return new;
    end $$;
    create trigger fail_try_end_once before update on gateway.webhook_deliveries
      for each row execute function public.fail_try_end_once();
  `);
}

t.test('a claim committed whose answer is lost on its way is handed back by its own live worker, then delivered', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t);
  await addTestEndpoint(gateway, { url: receiver.url });
  const proxy = await startTcpProxy(t, gateway.databaseUrl);
  const pool = createPool(proxy.url, { max: 2, applicationName: 'forgotten-claim', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  const workerId = await liveWorker(gateway);
  const { deliverer, runDueJobs } = testDeliverer(t, { db: createDb(pool), config: gateway.config }, { workerId });

  const requestId = await endRequest(gateway, key, 'completed');
  const [message] = await messagesOf(gateway.db, requestId);
  await gateway.pool.query(`delete from graphile_worker._private_jobs`);

  // The claim's answer (its rows: the columns "waiting" and "probe") never arrives: the
  // connection drops instead, and the claim, run again, finds the message delivering.
  const lost = proxy.dropNextReply('forgotten-claim', (reply) => reply.includes('waiting\0') && reply.includes('probe\0'));
  t.equal(await deliverer.deliver(message!.id, message!.endpoint_id), 'nothing', 'the claim run again finds nothing pending');
  await lost.dropped;
  t.match(await messagesOf(gateway.db, requestId), [{ status: 'delivering', worker_id: workerId, tries: 1 }], 'the message was claimed');
  t.match(await triesOf(gateway.db, message!.id), [{ outcome: 'running' }], 'with a try that nothing makes');
  t.equal(deliverer.inFlight, 0, 'and that the deliverer does not know of');

  await ageTry(gateway, message!.id);
  t.equal(await recoverLostDeliveries(gateway.db, 7_000, ['some-other-worker'], 1_000), 0, 'another worker\'s sweep passes it over: its worker beats');
  t.same(await wakeStrandedEndpoints(gateway.db, 7_000, 100), [], 'and the rescue looks only at pending messages');

  // The deliverer's own look, every 10 s (recoverForgotten).
  await until(async () => (await messagesOf(gateway.db, requestId))[0]!.status !== 'delivering', 'handed back by its worker', 15_000);
  t.match(await messagesOf(gateway.db, requestId), [{ status: 'pending', worker_id: null, tries: 1, finished_at: null }], 'pending again');
  t.match(await triesOf(gateway.db, message!.id), [{ try_number: 1, outcome: 'failed', error: 'the worker lost track of the try' }]);
  t.same((await deliveryJobs(gateway.db)).map((job) => job.message_id), [message!.id], 'with a job, due at once');

  t.same(await runDueJobs(), ['started']);
  await until(async () => (await messagesOf(gateway.db, requestId))[0]!.status === 'delivered', 'delivered');
  t.equal(receiver.deliveries.length, 1, 'sent once');
  t.match(await triesOf(gateway.db, message!.id), [{ outcome: 'failed' }, { try_number: 2, outcome: 'succeeded' }]);
});

t.test('a try\'s end that loses to a deadlock is recorded again', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, () => ({ status: 500 }));
  await addTestEndpoint(gateway, { url: receiver.url });
  // As when Postgres breaks a deadlock between a probe's claim and a 410's end by failing the end.
  await failNextTryEnd(gateway, '40P01', 'deadlock detected');
  const workerId = await liveWorker(gateway);
  const { deliverer, runDueJobs, logs } = testDeliverer(t, gateway, { workerId });

  const requestId = await endRequest(gateway, key, 'completed');
  const [message] = await messagesOf(gateway.db, requestId);
  t.same(await runDueJobs(), ['started']);
  await until(async () => (await messagesOf(gateway.db, requestId))[0]!.status !== 'delivering', 'the try\'s end recorded');
  t.equal(receiver.deliveries.length, 1, 'one try, answered 500');
  t.equal(deliverer.inFlight, 0, 'the try is over');
  t.match(await messagesOf(gateway.db, requestId), [{ status: 'pending', worker_id: null, tries: 1 }], 'to be retried on the schedule');
  t.match(await triesOf(gateway.db, message!.id), [{ try_number: 1, outcome: 'failed', http_status: 500, error: 'HTTP 500' }]);
  t.same((await deliveryJobs(gateway.db)).map((job) => job.message_id), [message!.id], 'with its retry\'s job');
  t.ok(logs.some((entry) => entry.msg === 'statement lost a conflict with another transaction; trying it again' && entry.err?.code === '40P01'), 'the deadlock was retried');
});

t.test('a try whose end fails for a reason no retry mends is handed back by its worker once old enough', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t);
  await addTestEndpoint(gateway, { url: receiver.url });
  await failNextTryEnd(gateway, '23514', 'some check failed');
  const workerId = await liveWorker(gateway);
  const { deliverer, runDueJobs, metrics } = testDeliverer(t, gateway, { workerId });

  const requestId = await endRequest(gateway, key, 'completed');
  const [message] = await messagesOf(gateway.db, requestId);
  t.same(await runDueJobs(), ['started']);
  await until(() => receiver.deliveries.length === 1 && deliverer.inFlight === 0, 'the try made, its end not recorded');
  t.match(await messagesOf(gateway.db, requestId), [{ status: 'delivering', worker_id: workerId }], 'the message stays delivering');
  t.equal(await deliverer.recoverForgotten(), 0, 'not yet: a try this young is left alone (a claim\'s answer could still be on its way)');
  await ageTry(gateway, message!.id);
  t.equal(await deliverer.recoverForgotten(), 1, 'handed back');
  t.match(await messagesOf(gateway.db, requestId), [{ status: 'pending', worker_id: null, tries: 1 }]);
  t.match(await triesOf(gateway.db, message!.id), [{ outcome: 'failed', error: 'the worker lost track of the try' }]);
  t.match(await metrics.render(), /gateway_webhook_deliveries_total\{outcome="failed"\} 1\b/, 'counted as a failed try');
  t.equal(await metricValue(metrics, 'gateway_webhook_deliveries_total{outcome="succeeded"}'), 0, 'and only so: its 2xx, never recorded, was not counted');
  t.equal(await deliverer.recoverForgotten(), 0, 'once');

  t.same(await runDueJobs(), ['started']);
  await until(async () => (await messagesOf(gateway.db, requestId))[0]!.status === 'delivered', 'delivered on the retry');
  t.equal(receiver.deliveries.length, 2, 'sent again: at least once');
});

t.test('a try in flight here is never taken for lost track of, however old', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, () => ({ hang: true }));
  await addTestEndpoint(gateway, { url: receiver.url });
  const workerId = await liveWorker(gateway);
  const { deliverer, runDueJobs } = testDeliverer(t, gateway, { workerId, webhooks: { timeoutMs: 10_000 } });

  const requestId = await endRequest(gateway, key, 'completed');
  const [message] = await messagesOf(gateway.db, requestId);
  t.same(await runDueJobs(), ['started']);
  await until(() => receiver.open === 1, 'the try waits for its answer');
  await ageTry(gateway, message!.id);
  t.equal(await deliverer.recoverForgotten(), 0, 'its try is under way here');
  t.equal(await deliverer.recoverForgotten(0), 0, 'whatever the age asked for');
  receiver.release({ status: 204 });
  await until(async () => (await messagesOf(gateway.db, requestId))[0]!.status === 'delivered', 'delivered');
  t.match(await triesOf(gateway.db, message!.id), [{ try_number: 1, outcome: 'succeeded' }], 'by its one try');
  await sleep(100);
  t.equal(receiver.deliveries.length, 1);
});
