// What a worker process keeps per queue is bounded however many models clients name: a queue's
// slot only while it is dispatched, and the routes of the queues dispatched most recently.
import t from 'tap';
import { createDb, createPool } from '../../src/db/pool.ts';
import { createLogger } from '../../src/logger.ts';
import { Metrics } from '../../src/metrics.ts';
import { createAttempts } from '../../src/worker/attempts.ts';
import { Dispatcher, dispatcherSettings } from '../../src/worker/dispatcher.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { queueOf } from '../helpers/rows.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';

t.test('a worker keeps no slot for a queue once its dispatch is over, and the routes of a few queues only', async (t) => {
  const upstream = await startFakeUpstream(t);
  const api = await startTestGateway(t, { role: 'api', env: { UPSTREAM_BASE_URL: upstream.baseUrl } });
  const { config } = api;
  const logger = createLogger({ logLevel: 'silent' });
  const pool = createPool(api.databaseUrl, { max: 4, applicationName: 'gateway-worker', logger });
  const db = createDb(pool);
  const metrics = new Metrics();
  const attempts = createAttempts({ db, config, metrics, logger });
  const dispatcher = new Dispatcher({ db, attempts, ...dispatcherSettings(config), routesRemembered: 5, metrics, logger });
  t.teardown(async () => {
    await dispatcher.stop();
    await attempts.close();
    await pool.end();
  });
  const live = clientFor(api.url, await api.createKey({ mode: 'live' }));
  const completed = async () => {
    const { rows } = await api.pool.query(`select count(*)::int as count from gateway.requests where status = 'completed'`);
    return rows[0].count as number;
  };

  const queues: string[] = [];
  for (let i = 0; i < 20; i++) {
    const answer = await live.post({ model: `invented-${i}`, messages: userMessage() });
    queues.push(await queueOf(api.db, answer.body.id));
  }
  await Promise.all(queues.map((queueId) => dispatcher.dispatch(queueId)));
  await until(async () => (await completed()) === 20, 'all 20 completed');
  await until(() => dispatcher.remembered.slots === 0, () => `no slot left (${dispatcher.remembered.slots})`);
  t.same(dispatcher.remembered, { slots: 0, routes: 5 }, 'twenty queues dispatched: no slot kept, five routes remembered');

  // A queue whose route was forgotten is read again when it is next dispatched.
  const again = await live.post({ model: 'invented-0', messages: userMessage('again') });
  t.equal(await queueOf(api.db, again.body.id), queues[0]);
  await dispatcher.dispatch(queues[0]!);
  await until(async () => (await completed()) === 21, 'the twenty-first completed');
  t.equal(upstream.calls.length, 21);
});
