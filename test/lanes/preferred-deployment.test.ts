// A model's first deployment takes its requests while it has room, whatever its later deployments
// wait for: a claim that leaves requests due on a lane with room (each project's share of a claim
// is capped) names no time to be dispatched again (room_at, queues.wake_at), so the worker claims
// again at once, rather than when a later deployment's 429 pause ends (sql/000027.sql).
import t from 'tap';
import { addDispatch, claimQueue, ensureLanes, ensureQueue } from '../../src/lanes/repository.ts';
import { NO_LIMITS } from '../../src/upstream/upstreams.ts';
import { testDatabasePool } from '../helpers/database.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { upstreamsFile } from '../helpers/upstreams-file.ts';
import { until } from '../helpers/wait.ts';

t.test('a claim that leaves requests due on a first lane with room names no room time, though the second is paused for an hour', async (t) => {
  const { pool, db } = await testDatabasePool(t, 'preferred-deployment-test');
  await pool.query(`insert into gateway.projects (name) values ('large'), ('small')`);
  const queueId = await ensureQueue(db, { mode: 'live', model: 'gpt-x' });
  const [first, second] = await ensureLanes(db, { id: queueId, mode: 'live', model: 'gpt-x' }, ['first', 'second']);
  // The second deployment answered a 429 with retry-after: 3600.
  await pool.query(`update gateway.lanes set paused_until = now() + interval '1 hour' where id = $1`, [second]);
  const plant = (project: string, count: number, from: number) =>
    pool.query(
      `insert into gateway.requests (id, project_id, mode, status, model, body, body_sha256, queue_id, next_attempt_at)
       select 'req_' || $1 || lpad((n + $2)::text, 20, '0'), projects.id, 'live', 'queued', 'gpt-x', '{}', sha256('b'), $3,
              now() - interval '1 minute' + (n + $2) * interval '1 millisecond'
       from gateway.projects, generate_series(1, $4::int) as n where projects.name = $1`,
      [project, from, queueId, count],
    );
  await plant('large', 1_000, 0);
  await plant('small', 1, 1_000);

  const lanes = [
    { laneId: first!, limits: NO_LIMITS },
    { laneId: second!, limits: NO_LIMITS },
  ];
  const claim = await claimQueue(db, queueId, 500, 'worker', lanes);
  // 250 of the large project's (half of 500, as two projects wait) and the small one's.
  t.equal(claim.started.length, 251, 'the first lane starts each project\'s share');
  t.ok(claim.started.every((started) => started.laneId === first), 'all on the first lane');
  t.ok(claim.waiting, 'requests are still due');
  t.equal(claim.roomInMs, undefined, 'no room time: the first lane has room now');
  const { rows } = await pool.query(`select wake_at from gateway.queues where id = $1`, [queueId]);
  t.equal(rows[0].wake_at, null, 'accepted requests are not told that the queue is dispatched later (queues.wake_at)');

  const next = await claimQueue(db, queueId, 500, 'worker', lanes);
  t.equal(next.started.length, 500, 'the next claim starts the large project\'s next 500 on the first lane');
});

t.test('requests left due on an idle first deployment all run on it, while the second is paused for an hour', async (t) => {
  const first = await startFakeUpstream(t);
  const second = await startFakeUpstream(t);
  const file = await upstreamsFile(t, [
    { name: 'first', base_url: first.baseUrl, models: ['gpt-x'] },
    { name: 'second', base_url: second.baseUrl, models: ['gpt-x'] },
  ]);
  // Claims of 10 at most; the API and the worker in processes of their own.
  const env = { UPSTREAMS_FILE: file, MAX_IN_FLIGHT: '10', WORKER_DEAD_AFTER_MS: '2000' };
  const api = await startTestGateway(t, { role: 'api', env });
  const large = clientFor(api.url, await api.createKey({ mode: 'live', project: 'large' }));
  const small = clientFor(api.url, await api.createKey({ mode: 'live', project: 'small' }));
  for (let n = 0; n < 20; n++) t.equal((await large.post({ model: 'gpt-x', messages: userMessage(`large ${n}`) })).status, 202);
  t.equal((await small.post({ model: 'gpt-x', messages: userMessage('small') })).status, 202);
  const { rows: queues } = await api.pool.query(`select id from gateway.queues where model = 'gpt-x'`);
  const [, secondLane] = await ensureLanes(api.db, { id: queues[0].id, mode: 'live', model: 'gpt-x' }, ['first', 'second']);
  // The second deployment answered a 429 with retry-after: 3600 a moment ago.
  await api.pool.query(`update gateway.lanes set paused_until = now() + interval '1 hour' where id = $1`, [secondLane]);
  // One dispatch for them all, as when the API stores a batch of requests in one statement.
  await api.pool.query(`delete from graphile_worker._private_jobs`);
  await addDispatch(api.db, queues[0].id);
  await startTestGateway(t, { role: 'worker', env, databaseUrl: api.databaseUrl });

  // The first claim starts 5 of the large project's (half of 10) and the small one's; the rest
  // take two claims more, at once. A wait for the second's pause would leave them queued.
  let completed = 0;
  await until(
    async () => {
      completed = (await api.pool.query(`select count(*)::int as n from gateway.requests where status = 'completed'`)).rows[0].n;
      return completed === 21;
    },
    () => `all 21 to complete (${completed} did)`,
    10_000,
  );
  t.equal(first.calls.length, 21, 'every request ran on the first deployment');
  t.equal(second.calls.length, 0);
});
