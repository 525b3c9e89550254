// MAX_PATTERN_MODELS: a pattern in UPSTREAMS_FILE lets clients name models of their own, each a
// queue and lanes; the queues of models that no upstream lists by name are bounded across the
// gateway, while names the file lists are never refused. And what an API process remembers of
// queues is bounded too, and looked up again often enough to keep them from being pruned.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { PATTERN_QUEUES_LOCK } from '../../src/lanes/repository.ts';
import { QueueRouter } from '../../src/lanes/routing.ts';
import { createLogger } from '../../src/logger.ts';
import { pruneQueues } from '../../src/worker/prune.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { apiWaitingOnLock, countRows } from '../helpers/rows.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { upstreamsFile } from '../helpers/upstreams-file.ts';
import { until } from '../helpers/wait.ts';

async function counts(gateway: TestGateway) {
  const { rows } = await gateway.pool.query(`
    select (select count(*)::int from gateway.requests) as requests,
           (select count(*)::int from gateway.signature_nonces) as nonces,
           (select count(*)::int from gateway.queues) as queues
  `);
  return rows[0];
}

async function queueModels(gateway: TestGateway): Promise<string[]> {
  const { rows } = await gateway.pool.query(`select model from gateway.queues where mode = 'live' order by model`);
  return rows.map((row) => row.model);
}

t.test('beyond MAX_PATTERN_MODELS a new model that only a pattern serves is a 400 naming model, and nothing is stored', async (t) => {
  const upstream = await startFakeUpstream(t);
  const file = await upstreamsFile(t, [
    { name: 'named', base_url: upstream.baseUrl, models: ['gpt-4o', { 'gpt-renamed': 'own-name' }, 'o3*'] },
    { name: 'catch-all', base_url: upstream.baseUrl, models: ['*'] },
  ]);
  const env = { UPSTREAMS_FILE: file, MAX_PATTERN_MODELS: '2' };
  const gateway = await startTestGateway(t, { role: 'api', env });
  const live = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const post = async (model: string) => (await live.post({ model, messages: userMessage() })).status;

  t.equal(await post('o3-mini'), 202, 'a first model that a pattern serves');
  t.equal(await post('llama-3'), 202, 'a second');
  t.same(await counts(gateway), { requests: 2, nonces: 2, queues: 2 });

  const refused = await live.post({ model: 'mistral-large', messages: userMessage() });
  t.equal(refused.status, 400, 'a third is refused');
  t.same(refused.body.error, {
    message: "Invalid 'model': the gateway already serves 2 models that no upstream lists by name, as many as it may; 'mistral-large' would be one more.",
    type: 'invalid_request_error',
    code: 'invalid_parameter',
    param: 'model',
  });
  t.same(await counts(gateway), { requests: 2, nonces: 2, queues: 2 }, 'no request, no nonce, no queue stored for it');

  t.equal(await post('gpt-4o'), 202, 'a model the file lists by name is never refused');
  t.equal(await post('gpt-renamed'), 202, 'nor one it renames');
  t.equal(await post('o3-mini'), 202, 'a pattern\'s model that has its queue is still served');
  const test = clientFor(gateway.url, await gateway.createKey({ mode: 'test' }));
  t.equal((await test.post({ model: 'test-echo', messages: userMessage() })).status, 202, 'test mode is not counted');
  t.same(await queueModels(gateway), ['gpt-4o', 'gpt-renamed', 'llama-3', 'o3-mini']);

  // Another API process, which remembers nothing yet: the bound is in the database.
  const other = await startTestGateway(t, { role: 'api', env, databaseUrl: gateway.databaseUrl });
  const otherLive = clientFor(other.url, await other.createKey({ mode: 'live', project: 'other' }));
  t.equal((await otherLive.post({ model: 'llama-3', messages: userMessage() })).status, 202, 'it finds the queues that exist');
  t.equal((await otherLive.post({ model: 'mistral-large', messages: userMessage() })).status, 400, 'and refuses a new one');
  t.equal(upstream.calls.length, 0);
});

t.test('the bound holds across API processes creating queues at the same moment', async (t) => {
  const upstream = await startFakeUpstream(t);
  const file = await upstreamsFile(t, [{ name: 'any', base_url: upstream.baseUrl, models: ['*'] }]);
  const env = { UPSTREAMS_FILE: file, MAX_PATTERN_MODELS: '5', DATABASE_POOL_SIZE: '20' };
  const first = await startTestGateway(t, { role: 'api', env });
  const second = await startTestGateway(t, { role: 'api', env, databaseUrl: first.databaseUrl });
  const clients = [
    clientFor(first.url, await first.createKey({ mode: 'live', project: 'one' })),
    clientFor(second.url, await second.createKey({ mode: 'live', project: 'two' })),
  ];
  const models = Array.from({ length: 20 }, (_, i) => `invented-${i}`);
  const answers = await Promise.all(
    models.flatMap((model) => clients.map(async (client) => ({ model, status: (await client.post({ model, messages: userMessage() })).status }))),
  );
  t.same(new Set(answers.map((answer) => answer.status)), new Set([202, 400]), 'each accepted or refused');
  const queued = await queueModels(first);
  t.equal(queued.length, 5, `five queues, not more (${queued.join(', ')})`);
  const accepted = answers.filter((answer) => answer.status === 202);
  t.ok(accepted.every((answer) => queued.includes(answer.model)), 'every request accepted is in one of them');
  t.equal(await countRows(first.db, 'requests'), accepted.length, 'and the refused stored nothing');
});

t.test('a pruned model frees its place under MAX_PATTERN_MODELS', async (t) => {
  const upstream = await startFakeUpstream(t);
  const file = await upstreamsFile(t, [{ name: 'any', base_url: upstream.baseUrl, models: ['*'] }]);
  const gateway = await startTestGateway(t, { role: 'api', env: { UPSTREAMS_FILE: file, MAX_PATTERN_MODELS: '1' } });
  const live = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  t.equal((await live.post({ model: 'first-model', messages: userMessage() })).status, 202);
  t.equal((await live.post({ model: 'second-model', messages: userMessage() })).status, 400);
  // Its request deleted (as retention does), and its queue unused for an hour.
  await gateway.pool.query('delete from gateway.requests');
  await gateway.pool.query(`update gateway.queues set used_at = now() - interval '2 hours'`);
  t.equal((await pruneQueues({ db: gateway.db, logger: silent }, 3_600_000)).length, 1, 'the idle queue is pruned');
  // A process that found the bound reached refuses new names for a second without a look.
  await until(
    async () => (await live.post({ model: 'second-model', messages: userMessage() })).status === 202,
    'the other model to have room',
    5_000,
  );
  t.same(await queueModels(gateway), ['second-model']);
});

t.test('an API process remembers at most its bound of queues, and looks one up again after a sixth of PRUNE_IDLE_QUEUES_AFTER', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { PRUNE_IDLE_QUEUES_AFTER: '3s' } });
  const router = new QueueRouter(gateway.db, gateway.config, { remembered: 3 });
  const route = async (model: string) => {
    const routed = await router.route('live', { model, messages: userMessage() });
    // A model's first route hands out its queue's creation, here run with no request.
    if (routed.creation) return { queueId: await routed.creation.run(async (_tx, queueId) => queueId, () => true) };
    return routed;
  };
  const usedAt = async (model: string): Promise<Date> => {
    const { rows } = await gateway.pool.query('select used_at from gateway.queues where model = $1', [model]);
    return rows[0].used_at;
  };

  for (let i = 0; i < 10; i++) await route(`model-${i}`);
  t.equal(router.remembered, 3, 'ten models routed, three remembered');

  const first = await usedAt('model-9');
  await sleep(50);
  const again = await route('model-9');
  t.same(await usedAt('model-9'), first, 'a remembered queue costs no statement');
  // The router remembers a queue for 500 ms here (3 s / 6).
  await sleep(700);
  t.equal((await route('model-9')).queueId, again.queueId, 'the same queue');
  t.ok((await usedAt('model-9')) > first, 'looked up again, and marked used');
});

t.test('a flood of new pattern-served models holds one of the API pool\'s connections, not all of them: other requests are served meanwhile', async (t) => {
  const upstream = await startFakeUpstream(t);
  const file = await upstreamsFile(t, [{ name: 'any', base_url: upstream.baseUrl, models: ['gpt-4o', '*'] }]);
  const gateway = await startTestGateway(t, { role: 'api', env: { UPSTREAMS_FILE: file } });
  const flooder = clientFor(gateway.url, await gateway.createKey({ mode: 'live', project: 'flooder' }));
  const other = clientFor(gateway.url, await gateway.createKey({ mode: 'live', project: 'other' }));
  t.equal((await other.post({ model: 'gpt-4o', messages: userMessage() })).status, 202, 'the other project\'s key and queue are known');

  // The lock that creations of pattern-served queues take in turn, held: each creation waits on it.
  const locker = await gateway.pool.connect();
  t.teardown(() => locker.release());
  await locker.query('select pg_advisory_lock($1::bigint)', [PATTERN_QUEUES_LOCK]);
  const waitingOnTheLock = () => apiWaitingOnLock(gateway.pool);

  const answers: number[] = [];
  const flood = Array.from({ length: 100 }, (_, i) =>
    flooder.post({ model: `invented-${i}`, messages: userMessage() }).then((answer) => answers.push(answer.status)),
  );
  await until(async () => (await waitingOnTheLock()) >= 1, 'a creation to reach the lock');
  await until(() => answers.length >= 35, 'the flood beyond the line to be answered');
  await sleep(300);
  t.equal(await waitingOnTheLock(), 1, 'one connection waits on the lock');
  t.equal(answers.length, 35, 'one creation under way and 64 in line; the rest answered at once');
  t.same(new Set(answers), new Set([503]), 'busy: 503');

  const accepted = await other.post({ model: 'gpt-4o', messages: userMessage() });
  t.equal(accepted.status, 202, 'another project\'s request is accepted meanwhile');
  t.equal((await other.get(accepted.body.id)).status, 200, 'and looked up');

  await locker.query('select pg_advisory_unlock($1::bigint)', [PATTERN_QUEUES_LOCK]);
  await Promise.all(flood);
  t.equal(answers.filter((status) => status === 202).length, 65, 'the creations in line go on once the lock is free');
});

const silent = createLogger({ logLevel: 'silent' });
