// gateway_webhook_deliveries_total counts a try once, by the process that records its end, with
// the outcome recorded. A worker taken for dead while its try is under way has the try handed
// back by the sweep of another (which counts it as failed); its late answer is recorded nowhere,
// and counted nowhere either.
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { until } from '../helpers/wait.ts';
import { addTestEndpoint, endRequest, messagesOf, metricValue, startReceiver, testDeliverer, triesOf } from './support.ts';

t.test('a try handed back by a sweep, then answered 2xx late: counted once, as failed, by the sweep\'s worker', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const receiver = await startReceiver(t, () => ({ hang: true }));
  await addTestEndpoint(gateway, { url: receiver.url });
  // The worker taken for dead (no heartbeat row), and the one whose sweep hands its try back.
  const frozen = testDeliverer(t, gateway, { workerId: 'worker-frozen', webhooks: { timeoutMs: 10_000 } });
  const sweeping = testDeliverer(t, gateway, { workerId: 'worker-sweeping' });

  const requestId = await endRequest(gateway, key, 'completed');
  const [message] = await messagesOf(gateway.db, requestId);
  t.same(await frozen.runDueJobs(), ['started']);
  await until(() => receiver.open === 1, 'the try waits for its answer');
  t.equal(await sweeping.deliverer.recoverLost(60_000, ['worker-sweeping'], 1_000, ['worker-frozen']), 1, 'the sweep hands the try back');
  t.match(await triesOf(gateway.db, message!.id), [{ try_number: 1, outcome: 'failed', error: 'the worker stopped during the try' }]);

  receiver.release({ status: 204 });
  await until(() => frozen.deliverer.inFlight === 0, 'the late answer');
  t.match(await triesOf(gateway.db, message!.id), [{ try_number: 1, outcome: 'failed' }], 'the late answer changed nothing');
  t.match(await messagesOf(gateway.db, requestId), [{ status: 'pending', tries: 1 }], 'the message waits for its next try');

  t.equal(await metricValue(sweeping.metrics, 'gateway_webhook_deliveries_total{outcome="failed"}'), 1, 'the sweep\'s worker counts it');
  for (const outcome of ['succeeded', 'failed', 'disabled']) {
    t.equal(await metricValue(frozen.metrics, `gateway_webhook_deliveries_total{outcome="${outcome}"}`), 0, `the late answer, recorded nowhere, is counted nowhere (${outcome})`);
  }
});
