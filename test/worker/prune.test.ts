// Pruning: a queue that no request refers to, unused for PRUNE_IDLE_QUEUES_AFTER, is deleted with
// its lanes by the workers; queues with requests (and the lanes that usage reports name) stay,
// and a model whose queue was pruned is served again, even by a process that remembered the
// pruned queue, and even while a prune runs.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { createLogger } from '../../src/logger.ts';
import { pruneQueues } from '../../src/worker/prune.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';

const HOUR_MS = 3_600_000;
const silent = createLogger({ logLevel: 'silent' });

async function queueRows(gateway: TestGateway) {
  const { rows } = await gateway.pool.query(`
    select queues.id, queues.model, count(lanes.id)::int as lanes
    from gateway.queues left join gateway.lanes on lanes.queue_id = queues.id
    where queues.mode = 'live'
    group by queues.id order by queues.model
  `);
  return rows as { id: string; model: string; lanes: number }[];
}

t.test('idle queues no request refers to are deleted with their lanes; those with requests or used lately stay', async (t) => {
  const upstream = await startFakeUpstream(t);
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl } });
  const live = clientFor(gateway.url, await gateway.createKey({ mode: 'live', project: 'prune' }));
  for (const model of ['idle-empty', 'idle-finished', 'idle-lane-only', 'recent-empty']) {
    t.equal((await live.post({ model, messages: userMessage(), wait: true })).status, 200, `${model} completed`);
  }
  // Retention deleted two requests; one finished before queues existed names only its lane.
  await gateway.pool.query(`delete from gateway.requests where model in ('idle-empty', 'recent-empty')`);
  await gateway.pool.query(`update gateway.requests set queue_id = null where model = 'idle-lane-only'`);
  await gateway.pool.query(`update gateway.queues set used_at = now() - interval '2 hours' where model like 'idle-%'`);
  const before = await queueRows(gateway);
  t.same(before.map((row) => row.lanes), [1, 1, 1, 1], 'each model has its queue and lane');

  const pruned = await pruneQueues({ db: gateway.db, logger: silent }, HOUR_MS);
  t.same(pruned, [before.find((row) => row.model === 'idle-empty')!.id], 'one queue pruned');
  t.same((await queueRows(gateway)).map((row) => [row.model, row.lanes]), [
    ['idle-finished', 1],
    ['idle-lane-only', 1],
    ['recent-empty', 1],
  ], 'its lane gone with it; a queue or lane with a request, and a queue used within the hour, kept');

  const { rows: usage } = await gateway.pool.query(
    `select upstream, model, requests::int from gateway.usage_daily where project = 'prune' order by model`,
  );
  t.same(usage, [
    { upstream: 'default', model: 'idle-finished', requests: 1 },
    { upstream: 'default', model: 'idle-lane-only', requests: 1 },
  ], 'usage still names the upstream of every request it reports');

  t.same(await pruneQueues({ db: gateway.db, logger: silent }, HOUR_MS), [], 'a second prune finds nothing');
});

t.test('a model whose queue was pruned is served again by a process that remembered the queue', async (t) => {
  const upstream = await startFakeUpstream(t);
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl } });
  const live = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const first = await live.post({ model: 'comeback', messages: userMessage(), wait: true });
  t.equal(first.status, 200);
  const [pruned] = await queueRows(gateway);
  await gateway.pool.query('delete from gateway.requests');
  await gateway.pool.query(`update gateway.queues set used_at = now() - interval '2 hours'`);
  t.same(await pruneQueues({ db: gateway.db, logger: silent }, HOUR_MS), [pruned!.id]);

  // The API still remembers the pruned queue: its insert finds it gone, and routes it again.
  const again = await live.post({ model: 'comeback', messages: userMessage('again'), wait: true });
  t.equal(again.status, 200, `completed (${again.text})`);
  const [recreated] = await queueRows(gateway);
  t.equal(recreated!.model, 'comeback');
  t.not(recreated!.id, pruned!.id, 'in a new queue, with its lane');
  t.equal(recreated!.lanes, 1);
  t.equal(upstream.calls.length, 2);
});

t.test('the workers prune on their own, every tenth of PRUNE_IDLE_QUEUES_AFTER', async (t) => {
  const upstream = await startFakeUpstream(t);
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl, PRUNE_IDLE_QUEUES_AFTER: '1s' } });
  const live = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  t.equal((await live.post({ model: 'brief', messages: userMessage(), wait: true })).status, 200);
  await sleep(1_500);
  t.equal((await queueRows(gateway)).length, 1, 'a queue with a request stays, however long unused');
  await gateway.pool.query('delete from gateway.requests');
  await until(async () => (await queueRows(gateway)).length === 0, 'the queue pruned', 5_000);
  const { rows } = await gateway.pool.query('select count(*)::int as lanes from gateway.lanes');
  t.equal(rows[0].lanes, 0, 'with its lane');
  t.equal((await live.post({ model: 'brief', messages: userMessage(), wait: true })).status, 200, 'and the model served again');
});

t.test('a prune loop running beside bursts of requests for pruned models loses none and answers every one', async (t) => {
  const upstream = await startFakeUpstream(t);
  const gateway = await startTestGateway(t, { role: 'api', env: { UPSTREAM_BASE_URL: upstream.baseUrl, DATABASE_POOL_SIZE: '20' } });
  const live = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  // Queues unused for 2 s are pruned, again and again, while the API remembers them for ten minutes.
  let pruning = true;
  let prunes = 0;
  const pruner = (async () => {
    while (pruning) {
      prunes += (await pruneQueues({ db: gateway.db, logger: silent }, 2_000)).length;
      await sleep(5);
    }
  })();
  t.teardown(async () => {
    pruning = false;
    await pruner;
  });

  const models = Array.from({ length: 5 }, (_, i) => `churn-${i}`);
  for (let wave = 0; wave < 4; wave++) {
    const answers = await Promise.all(
      Array.from({ length: 50 }, (_, i) => live.post({ model: models[i % models.length], messages: userMessage(`${wave}-${i}`) })),
    );
    const statuses = answers.map((answer) => answer.status);
    t.same(new Set(statuses), new Set([202]), `wave ${wave}: all 50 accepted (${[...new Set(answers.filter((answer) => answer.status !== 202).map((answer) => answer.text))].join('; ')})`);
    const { rows } = await gateway.pool.query('select count(*)::int as requests from gateway.requests');
    t.equal(rows[0].requests, 50, `wave ${wave}: all 50 stored`);
    // Retention takes them; their queues are then idle, and pruned before the next wave.
    await gateway.pool.query('delete from gateway.requests');
    await sleep(2_500);
  }
  pruning = false;
  await pruner;
  t.ok(prunes >= 15, `queues were pruned under the API's feet (${prunes} prunes)`);
});
