// gateway_attempts_total counts an attempt once, by the process that records its end, with the
// outcome recorded. A worker taken for dead while its call is under way has its attempt recorded
// as worker_lost by the sweep of another (which counts it); its late answer, a failure or a
// completion, is recorded nowhere, and counted nowhere either.
import { Writable } from 'node:stream';
import t from 'tap';
import { createLogger } from '../../src/logger.ts';
import { Metrics } from '../../src/metrics.ts';
import { createAttempts, type CallTarget } from '../../src/worker/attempts.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { attemptRows, claimQueueOf, requestRow } from '../helpers/rows.ts';
import { completionFor, startFakeUpstream, type Reply } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';

/** The samples of gateway_attempts_total that `metrics` has, as [name, value]. */
async function attemptsCounted(metrics: Metrics): Promise<[string, number][]> {
  return [...parseMetrics(await metrics.render())].filter(([name]) => name.startsWith('gateway_attempts_total{'));
}

for (const [late, reply] of [
  ['a failure (HTTP 500)', (): Reply => ({ status: 500, json: { error: { message: 'boom' } } })],
  ['a completion', (): Reply => ({ status: 200, json: completionFor({}) })],
] as const) {
  t.test(`an attempt recorded as worker_lost by a sweep, then answered late with ${late}: counted once, as worker_lost, by the sweep's worker`, async (t) => {
    let answer!: () => void;
    const answered = new Promise<void>((resolve) => (answer = resolve));
    const upstream = await startFakeUpstream(t, async () => {
      await answered;
      return reply();
    });
    const gateway = await startTestGateway(t, { role: 'api', env: { UPSTREAM_BASE_URL: upstream.baseUrl } });
    const accepted = await clientFor(gateway.url, await gateway.createKey({ mode: 'live' })).post({ model: 'gpt-test', messages: userMessage() });
    const id = accepted.body.id as string;
    const logger = createLogger(gateway.config, new Writable({ write: (_chunk, _encoding, done) => done() }));
    // The worker taken for dead, and the one whose sweep records its attempt.
    const [frozen, sweeping] = [new Metrics(), new Metrics()].map((metrics) => ({ metrics, attempts: createAttempts({ db: gateway.db, config: gateway.config, metrics, logger }) }));
    t.teardown(() => Promise.all([frozen!.attempts.close(), sweeping!.attempts.close()]));

    const started = (await claimQueueOf(gateway.db, id, 1, 'worker-frozen')).started[0]!;
    const target: CallTarget = { mode: 'live', upstream: gateway.config.upstreams[0], model: undefined, modelLabel: 'gpt-test' };
    const running = frozen!.attempts.run(target, started, new AbortController().signal);
    await until(() => upstream.calls.length === 1, 'the call under way');

    const row = (await requestRow(gateway.db, id))!;
    await sweeping!.attempts.recover([{ id, attempt: started.attempt, mode: 'live', queue_id: row.queue_id, charged: started.charged }]);
    t.match(await attemptRows(gateway.db, id), [{ outcome: 'failed', error_code: 'worker_lost' }], 'the sweep recorded the attempt');
    answer();
    await running;
    t.match(await attemptRows(gateway.db, id), [{ outcome: 'failed', error_code: 'worker_lost' }], 'the late answer changed nothing');

    t.same(await attemptsCounted(sweeping!.metrics), [['gateway_attempts_total{mode="live",outcome="failed",code="worker_lost"}', 1]], 'the sweep\'s worker counts it');
    t.same(await attemptsCounted(frozen!.metrics), [], 'the late answer, recorded nowhere, is counted nowhere');
  });
}
