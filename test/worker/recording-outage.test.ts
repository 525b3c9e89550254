// An outcome is recorded however long the database stays unavailable: an upstream answer
// already paid for is not dropped (to be recovered as worker_lost and called again), nor is a
// webhook try's end (to be delivered again). Only a shutdown past its grace gives up, and then
// the attempt stays running for the sweep to recover.
import { Writable } from 'node:stream';
import { setTimeout as sleep } from 'node:timers/promises';
import type { Test } from 'tap';
import t from 'tap';
import { createDb, createPool } from '../../src/db/pool.ts';
import type { StartedAttempt } from '../../src/lanes/repository.ts';
import { createLogger } from '../../src/logger.ts';
import { Metrics } from '../../src/metrics.ts';
import { createAttempts, type CallTarget } from '../../src/worker/attempts.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { attemptRows, claimQueueOf, requestRow } from '../helpers/rows.ts';
import { startTcpProxy, type TcpProxy } from '../helpers/tcp-proxy.ts';
import { completionFor, startFakeUpstream } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';
import { addTestEndpoint, endRequest, messagesOf, startReceiver, testDeliverer, triesOf } from '../webhooks/support.ts';

// Longer than a minute: longer than the patience of the worker's other statements (OUTAGE_PATIENCE_MS).
const OUTAGE_MS = 65_000;

/** A gateway's database, a worker's pool on it through a proxy that can be cut, and a started live attempt. */
async function setup(t: Test) {
  let cutDuringCall: TcpProxy | undefined;
  const upstream = await startFakeUpstream(t, async (call) => {
    // The database goes away while the call is under way.
    cutDuringCall?.cut();
    return { status: 200, json: completionFor(call.body) };
  });
  const gateway = await startTestGateway(t, { role: 'api', env: { UPSTREAM_BASE_URL: upstream.baseUrl } });
  const key = await gateway.createKey({ mode: 'live' });
  const proxy = await startTcpProxy(t, gateway.databaseUrl);
  const logs: string[] = [];
  // Told of each line as it is logged, in the logger's call (pino writes to the sink at once).
  const listeners: ((line: string) => void)[] = [];
  const sink = new Writable({
    write(chunk: Buffer, _encoding, done) {
      for (const line of chunk.toString('utf8').split('\n').filter(Boolean)) {
        logs.push(line);
        for (const listener of listeners) listener(line);
      }
      done();
    },
  });
  const logger = createLogger({ logLevel: 'debug' }, sink);
  const pool = createPool(proxy.url, { max: 4, applicationName: 'gateway-worker', logger });
  t.teardown(() => pool.end());
  const workerDb = createDb(pool);
  const attempts = createAttempts({ db: workerDb, config: gateway.config, metrics: new Metrics(), logger });
  t.teardown(() => attempts.close());

  const accepted = await clientFor(gateway.url, key).post({ model: 'gpt-test', messages: userMessage() });
  const claim = await claimQueueOf(gateway.db, accepted.body.id, 1, 'worker-recording-test');
  const started = claim.started[0]!;
  const target: CallTarget = { mode: 'live', upstream: gateway.config.upstreams[0], model: undefined, modelLabel: 'gpt-test' };
  const run = (signal: AbortSignal) => {
    cutDuringCall = proxy;
    return attempts.run(target, started, signal);
  };
  const onLog = (listener: (line: string) => void) => listeners.push(listener);
  return { gateway, key, proxy, upstream, workerDb, attempts, started, run, logs, onLog };
}

async function settledWithin<T>(promise: Promise<T>, ms: number): Promise<{ value: T } | undefined> {
  return Promise.race([promise.then((value) => ({ value })), sleep(ms).then(() => undefined)]);
}

t.test(`an answer and a webhook try's end are recorded after a ${OUTAGE_MS / 1000} s outage: the upstream called once, the webhook delivered once`, async (t) => {
  const { gateway, key, proxy, upstream, workerDb, run, started, logs } = await setup(t);

  // A webhook try under way, whose end comes during the outage.
  const receiver = await startReceiver(t, () => ({ hang: true }));
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  receiver.secrets = [endpoint.secret];
  const hooks = testDeliverer(t, { db: workerDb, config: gateway.config }, { shutdownGraceMs: 1_000 });
  const endedId = await endRequest(gateway, key, 'completed');
  t.same(await hooks.runDueJobs(), ['started']);
  await until(() => receiver.deliveries.length === 1, 'the delivery');

  const recording = run(new AbortController().signal);
  await until(() => upstream.calls.length === 1, 'the upstream call');
  receiver.release({ status: 204 });
  const outageStart = Date.now();
  t.equal(await settledWithin(recording, OUTAGE_MS), undefined, 'the answer is still being recorded when the outage has lasted a minute and more');
  proxy.restore();
  t.comment(`the database was unavailable for ${Date.now() - outageStart} ms`);

  await t.resolves(recording, 'the run ends once the database is back');
  const row = await requestRow(gateway.db, started.id);
  t.match(row, { status: 'completed', attempts: 1 }, 'recorded once the database is back');
  t.match(await attemptRows(gateway.db, started.id), [{ outcome: 'succeeded' }]);
  t.equal(upstream.calls.length, 1, 'the upstream was called once');
  t.ok(logs.some((line) => line.includes('retrying the recording until it is back')));

  const [message] = await messagesOf(gateway.db, endedId);
  await until(async () => (await messagesOf(gateway.db, endedId))[0]?.status === 'delivered', 'the try recorded', 10_000);
  t.match(await triesOf(gateway.db, message!.id), [{ try_number: 1, http_status: 204 }], "the webhook try's end recorded");
  t.equal(receiver.deliveries.length, 1, 'delivered once');
  t.notOk(hooks.logs.some((line) => line.msg === 'could not record a webhook try'));
});

t.test('at shutdown past its grace, a recording still waiting for the database is given up: the attempt stays running for the sweep', async (t) => {
  const { gateway, proxy, upstream, attempts, run, started, logs, onLog } = await setup(t);
  const recording = run(new AbortController().signal);
  await until(() => logs.some((line) => line.includes('retrying the recording until it is back')), 'the recording to wait for the database', 10_000);
  t.equal(upstream.calls.length, 1, 'the upstream answered');
  t.equal(await settledWithin(recording, 0), undefined, 'still retrying');
  // Given up while it waits for its next try (a wait of 100 ms to 2 s, begun right after the
  // line saying so is logged): it ends before any timer fires, so without that wait.
  const givenUp = new Promise<{ value: number | undefined } | undefined>((resolve) => {
    let armed = true;
    onLog((line) => {
      if (!armed || !line.includes('retrying the recording until it is back')) return;
      armed = false;
      queueMicrotask(() => {
        attempts.abandonRecordings();
        resolve(settledWithin(recording, 0));
      });
    });
  });
  t.ok(await givenUp, 'given up at once, its wait for the next try cut short');
  await t.resolves(recording, 'given up');
  proxy.restore();
  t.match(await requestRow(gateway.db, started.id), { status: 'processing' });
  t.match(await attemptRows(gateway.db, started.id), [{ outcome: 'running' }], 'left running, for the sweep to record as worker_lost');
});

t.test("at shutdown past its grace, a webhook try's end still waiting for the database is given up, and stop() returns", async (t) => {
  const gateway: TestGateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const proxy = await startTcpProxy(t, gateway.databaseUrl);
  const pool = createPool(proxy.url, { max: 4, applicationName: 'gateway-worker', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  const receiver = await startReceiver(t, () => ({ hang: true }));
  const endpoint = await addTestEndpoint(gateway, { url: receiver.url });
  receiver.secrets = [endpoint.secret];
  const hooks = testDeliverer(t, { db: createDb(pool), config: gateway.config }, { shutdownGraceMs: 500 });
  const endedId = await endRequest(gateway, key, 'completed');
  t.same(await hooks.runDueJobs(), ['started']);
  await until(() => receiver.deliveries.length === 1, 'the delivery');
  proxy.cut();
  receiver.release({ status: 204 });
  await sleep(3_000);
  // The database stays cut until stop() has returned: the try's end would wait for it for ever,
  // had stop() not given it up after its grace.
  await hooks.deliverer.stop();
  t.ok(hooks.logs.some((line) => line.msg === 'could not record a webhook try'), 'the try given up');
  t.pass('stop() returned while the database was still unavailable');
  proxy.restore();
  t.match(await messagesOf(gateway.db, endedId), [{ status: 'delivering' }], 'its message left delivering, for the sweep to hand back');
});
