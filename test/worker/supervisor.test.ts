// The worker supervisor: dead pools' jobs are released, and a pool that stops on its own is
// replaced, so requests finish without a restart. A live worker is never taken for dead: not
// while its event loop stalls, nor while it stops and its calls in flight land. A dead one is
// found when its heartbeat comes of age, with all its attempts, recorded once however many
// workers sweep.
import { Writable } from 'node:stream';
import { setTimeout as sleep } from 'node:timers/promises';
import t, { type Test } from 'tap';
import { createDb, createPool } from '../../src/db/pool.ts';
import { createLogger } from '../../src/logger.ts';
import { Metrics } from '../../src/metrics.ts';
import { WebhookDeliverer } from '../../src/webhooks/deliverer.ts';
import { createAttempts } from '../../src/worker/attempts.ts';
import { Dispatcher, dispatcherSettings } from '../../src/worker/dispatcher.ts';
import { startWorkerService } from '../../src/worker/supervisor.ts';
import { sweep } from '../../src/worker/supervisor-repository.ts';
import { startTestGateway, TEST_SETTINGS } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { attemptRows, dispatchJobs, isTerminal, queueOf, requestRow, waitForRow } from '../helpers/rows.ts';
import { serveSettings, spawnServe } from '../helpers/serve.ts';
import { heldUpstream } from '../helpers/upstream.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { until, waitFor } from '../helpers/wait.ts';

/** A worker's parts, built as main.ts builds them, so that the test holds its WorkerService. */
async function startWorkerIn(t: Test, gateway: Awaited<ReturnType<typeof startTestGateway>>) {
  const { config } = gateway;
  const logs: string[] = [];
  const logger = createLogger(config, new Writable({ write: (chunk: Buffer, _encoding, done) => (logs.push(chunk.toString('utf8')), done()) }));
  const pool = createPool(gateway.databaseUrl, { max: 4, applicationName: 'gateway-worker', logger });
  const db = createDb(pool);
  const metrics = new Metrics();
  const attempts = createAttempts({ db, config, metrics, logger });
  const dispatcher = new Dispatcher({ db, attempts, ...dispatcherSettings(config), metrics, logger });
  const deliverer = new WebhookDeliverer({ db, config, workerId: dispatcher.workerId, metrics, logger });
  const started = await startWorkerService({ config, pool, db, metrics, logger, dispatcher, deliverer, attempts });
  // Stopped once, by the test or else at its end.
  let stopped: Promise<void> | undefined;
  const service = { stop: () => (stopped ??= started.stop()) };
  t.teardown(async () => {
    await service.stop();
    await attempts.close();
    await pool.end();
  });
  return { service, logs };
}

async function lockedJobs(gateway: Awaited<ReturnType<typeof startTestGateway>>) {
  const { rows } = await gateway.pool.query(`select id, locked_by from graphile_worker._private_jobs order by id`);
  return rows as { id: string; locked_by: string | null }[];
}

t.test('the sweep releases the jobs of pools presumed dead, and only theirs', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  // Each request accepted alone adds a job that wakes its lane.
  for (let i = 0; i < 3; i++) await client.post({ model: 'm', messages: userMessage() });
  const jobs = await lockedJobs(gateway);
  t.equal(jobs.length, 3);

  // Three jobs, locked a minute ago by: a pool whose heartbeat stopped, a pool that never had
  // one (it died before its first beat), and a live pool.
  await gateway.pool.query(`
    insert into gateway.worker_pools (id, hostname, pid, last_seen_at) values
      ('pool-dead', 'h', 1, now() - interval '1 minute'),
      ('pool-live', 'h', 2, now())`);
  const lockers = ['pool-dead', 'pool-never-seen', 'pool-live'];
  for (const [index, job] of jobs.entries()) {
    await gateway.pool.query(
      `update graphile_worker._private_jobs set locked_by = $2, locked_at = now() - interval '1 minute' where id = $1`,
      [job.id, lockers[index]],
    );
  }

  const swept = await sweep(gateway.db, 10_000);
  t.same(swept.released.sort(), ['pool-dead', 'pool-never-seen']);
  t.ok(
    swept.nextDeathInMs !== null && swept.nextDeathInMs > 9_000 && swept.nextDeathInMs <= 10_000,
    `the live pool, beaten just now, is due to be found dead in 10 s (${swept.nextDeathInMs} ms)`,
  );
  t.same(
    (await lockedJobs(gateway)).map((job) => job.locked_by),
    [null, null, 'pool-live'],
    'the dead pools\' jobs are free to run again; the live pool keeps its own',
  );
  const { rows } = await gateway.pool.query('select id from gateway.worker_pools');
  t.same(rows.map((row) => row.id), ['pool-live'], 'the dead pool is forgotten');
  t.same((await sweep(gateway.db, 10_000)).released, [], 'a second sweep finds nothing');
  t.equal((await sweep(gateway.db, 10_000, ['pool-live'])).nextDeathInMs, null, 'and, the live pool being the caller\'s own, no one due');
});

t.test('a worker pool that stops on its own is replaced, and its request completes', async (t) => {
  const gateway = await startTestGateway(t, { env: { WORKER_DEAD_AFTER_MS: '2000' } });
  const client = clientFor(gateway.url, await gateway.createKey());
  // graphile-worker stops a pool that cannot record a job's end (as when Postgres is down).
  // Make recording the end of the first job fail, once.
  await gateway.pool.query(`
    create sequence public.refusals;
    create function public.refuse_once() returns trigger language plpgsql as $$
    begin
      -- nextval is not rolled back with the failing transaction, so this refuses once only.
      if nextval('public.refusals') = 1 then
        raise exception 'simulated failure to release a job';
      end if;
      return old;
    end $$;
    create trigger refuse_once before delete on graphile_worker._private_jobs
      for each row execute function public.refuse_once();`);
  const { rows: before } = await gateway.pool.query(`select id from gateway.worker_pools where id like 'pool-%'`);
  t.equal(before.length, 1, 'one pool beating');

  const accepted = await client.post({ model: 'test-echo', messages: userMessage() });
  const row = await waitForRow(gateway.db, accepted.body.id, isTerminal, 20_000);
  t.equal(row.status, 'completed');

  // The job's end could not be recorded, so its pool stopped; a new pool took over, released the
  // job, which ran again and found its request already completed.
  for (let i = 0; (await lockedJobs(gateway)).length > 0; i++) {
    if (i > 500) throw new Error('the job was never released and finished');
    await sleep(20);
  }
  // The stopped pool's row goes when it stops, and its replacement's comes when that has started:
  // on a busy machine, the job may be free and done in between. Waited for up to 10 s.
  let after: { id: string }[] = [];
  await waitFor(async () => {
    ({ rows: after } = await gateway.pool.query(`select id from gateway.worker_pools where id like 'pool-%'`));
    return after.length === 1 && after[0]!.id !== before[0].id;
  }, 10_000, 20);
  t.equal(after.length, 1, 'one pool beating');
  t.not(after[0]?.id, before[0].id, 'a new one');
  t.ok(gateway.logs.some((line) => /worker pool (stopping|stopped) on its own/.test(line)), 'the restart is logged');

  const next = await client.post({ model: 'test-echo', messages: userMessage(), wait: true });
  t.equal(next.status, 200, 'and requests keep completing');
});

t.test('a worker whose event loop stalls for 2 s keeps its heartbeat row and its attempt: another worker does not take it for dead', async (t) => {
  const upstream = await heldUpstream(t);
  const api = await startTestGateway(t, { role: 'api' });
  // WORKER_DEAD_AFTER_MS is the default (7 s), in both workers.
  const stalling = spawnServe(
    t,
    serveSettings(api, 0, {
      ...TEST_SETTINGS,
      UPSTREAM_BASE_URL: upstream.baseUrl,
      UPSTREAM_TIMEOUT_MS: '60000',
      NODE_OPTIONS: `--import ${new URL('../helpers/stall-on-signal.ts', import.meta.url).pathname}`,
    }),
    ['--role', 'worker'],
  );
  await until(() => stalling.output().includes('worker pool started'), () => `the worker:\n${stalling.output()}`, 15_000);
  const accepted = await clientFor(api.url, await api.createKey({ mode: 'live' })).post({ model: 'gpt-x', messages: userMessage() });
  const id = accepted.body.id as string;
  await until(() => upstream.calls.length === 1, 'the call to reach the upstream');
  const workerId = (await attemptRows(api.db, id))[0]!.worker_id!;
  const peer = await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env: { UPSTREAM_BASE_URL: upstream.baseUrl } });

  // The age of the stalled worker's heartbeat, as another worker's sweep sees it.
  const ages: (number | null)[] = [];
  let sampling = true;
  const sampled = (async () => {
    while (sampling) {
      const { rows } = await api.pool.query(
        `select (extract(epoch from now() - last_seen_at) * 1000)::int as age from gateway.worker_pools where id = $1`,
        [workerId],
      );
      ages.push(rows[0]?.age ?? null);
      await sleep(50);
    }
  })();
  stalling.signal('SIGUSR2');
  await until(() => stalling.output().includes('stalled the event loop'), 'the stall', 10_000);
  // Its heartbeat comes back within a beat; two of the peer's sweeps after that.
  await sleep(4_000);
  sampling = false;
  await sampled;

  const oldest = Math.max(...ages.filter((age) => age !== null));
  t.comment(`${stalling.output().match(/stalled the event loop for \d+ ms/)![0]}; its heartbeat was at most ${oldest} ms old (dead after 7000)`);
  t.ok(ages.every((age) => age !== null), 'its row was never deleted');
  t.ok(oldest >= 1_500 && oldest < 7_000, 'and the stall showed in its age, which stayed below WORKER_DEAD_AFTER_MS');
  t.match(await attemptRows(api.db, id), [{ outcome: 'running', worker_id: workerId }], 'its attempt is still its own, running');
  t.notOk(peer.logs.some((line) => /attempt lost with its worker|released the jobs of dead workers/.test(line)), 'the peer recovered nothing');

  upstream.release();
  t.match(await waitForRow(api.db, id, isTerminal), { status: 'completed', attempts: 1 }, 'the stalled worker completes the request');
  t.match(await attemptRows(api.db, id), [{ attempt_number: 1, outcome: 'succeeded', worker_id: workerId }], 'in its one attempt');
});

t.test('a stopping worker keeps its heartbeat until its call has landed: no other worker takes the call for lost, and its answer is recorded', async (t) => {
  const upstream = await heldUpstream(t);
  const stopping = await startTestGateway(t, {
    env: { UPSTREAM_BASE_URL: upstream.baseUrl, UPSTREAM_TIMEOUT_MS: '60000', WORKER_DEAD_AFTER_MS: '4000', SHUTDOWN_GRACE_MS: '3900' },
  });
  const accepted = await clientFor(stopping.url, await stopping.createKey({ mode: 'live' })).post({ model: 'gpt-x', messages: userMessage() });
  const id = accepted.body.id as string;
  await until(() => upstream.calls.length === 1, 'the call to reach the upstream');
  const workerId = (await attemptRows(stopping.db, id))[0]!.worker_id!;
  // The peer presumes a worker dead after 1.5 s without a beat (the stopping one beats every
  // 0.8 s), sooner than the stopping one's own setting: a heartbeat that ended with the stop
  // would be found stale in the middle of the grace, while the call is still under way.
  const peer = await startTestGateway(t, {
    role: 'worker',
    databaseUrl: stopping.databaseUrl,
    env: { UPSTREAM_BASE_URL: upstream.baseUrl, WORKER_DEAD_AFTER_MS: '1500' },
  });

  // Past the peer's 1.5 s and its next sweep, well within the stopping worker's grace.
  const stopped = stopping.stop();
  await sleep(2_200);
  t.ok(await requestRow(stopping.db, id).then((row) => row?.status === 'processing'), 'the call is still under way 2.2 s into the stop');
  upstream.release();
  await stopped;

  t.match(await requestRow(stopping.db, id), { status: 'completed', attempts: 1 }, 'its answer completed the request');
  t.match(await attemptRows(stopping.db, id), [{ attempt_number: 1, outcome: 'succeeded', worker_id: workerId }], 'recorded by the stopping worker');
  t.equal(upstream.calls.length, 1, 'the upstream was called once');
  t.notOk(peer.logs.some((line) => line.includes('attempt lost with its worker')), 'the peer took nothing for lost');
  const { rows } = await stopping.pool.query('select id from gateway.worker_pools where id = $1', [workerId]);
  t.same(rows, [], 'then the stopped worker\'s row is released');
});

t.test('stop() waits for a sweep under way: one held by a lock ends before stop() resolves', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { WORKER_DEAD_AFTER_MS: '2000' } });
  const { service, logs } = await startWorkerIn(t, gateway);

  // The sweep's last statement (the webhook tries of dead workers) waits for this lock.
  const locker = await gateway.pool.connect();
  await locker.query('begin');
  await locker.query('lock table gateway.webhook_messages in access exclusive mode');
  await until(async () => {
    const { rows } = await gateway.pool.query(
      `select from pg_stat_activity where application_name = 'gateway-worker' and wait_event_type = 'Lock' and query like '%webhook_messages%'`,
    );
    return rows.length > 0;
  }, 'a sweep waiting for the lock');

  let stopped = false;
  const stopping = service.stop().then(() => {
    stopped = true;
  });
  // Longer than the rest of the stop takes here (no calls, no tries: the grace is not waited for).
  await sleep(1_500);
  t.notOk(stopped, 'stop() has not resolved while the sweep waits');
  await locker.query('commit');
  locker.release();
  await stopping;
  t.ok(stopped, 'it resolves once the sweep has ended');
  t.notOk(logs.some((line) => line.includes('sweep failed')), 'and the sweep ended without failing');
});

t.test('stop() during the restart of a pool that stopped on its own waits for the new pool, which never takes over', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const { service, logs } = await startWorkerIn(t, gateway);
  // Recording the end of the first job fails, once: the pool stops on its own.
  await gateway.pool.query(`
    create sequence public.refusals;
    create function public.refuse_once() returns trigger language plpgsql as $$
    begin
      if nextval('public.refusals') = 1 then raise exception 'simulated failure to release a job'; end if;
      return old;
    end $$;
    create trigger refuse_once before delete on graphile_worker._private_jobs
      for each row execute function public.refuse_once();`);
  // The restart's run() reads graphile_worker.migrations: it waits while this lock is held.
  const locker = await gateway.pool.connect();
  await locker.query('begin');
  await locker.query('lock table graphile_worker.migrations in access exclusive mode');

  await clientFor(gateway.url, await gateway.createKey()).post({ model: 'test-echo', messages: userMessage() });
  await until(async () => {
    const { rows } = await gateway.pool.query(
      `select from pg_stat_activity where application_name = 'gateway-worker' and wait_event_type = 'Lock' and query like '%.migrations%'`,
    );
    return rows.length > 0;
  }, 'the restart waiting for the lock', 10_000);
  t.ok(logs.some((line) => /worker pool (stopping|stopped) on its own/.test(line)), 'the pool stopped on its own');
  const startedBefore = logs.filter((line) => line.includes('worker pool started')).length;

  let stopped = false;
  const stopping = service.stop().then(() => {
    stopped = true;
  });
  await sleep(1_500);
  t.notOk(stopped, 'stop() has not resolved while the new pool is starting');
  await locker.query('commit');
  locker.release();
  await stopping;

  const heartbeats = async () => (await gateway.pool.query(`select id from gateway.worker_pools`)).rows;
  t.same(await heartbeats(), [], 'no heartbeat row is left when stop() resolves');
  await sleep(1_000);
  t.equal(logs.filter((line) => line.includes('worker pool started')).length, startedBefore, 'the new pool never took over');
  t.same(await heartbeats(), [], 'nor is one written since');
  t.same((await lockedJobs(gateway)).filter((job) => job.locked_by !== null), [], 'no job is held');
});

t.test('a worker is found dead when its heartbeat reaches WORKER_DEAD_AFTER_MS, not at the next periodic sweep, with its attempt started after that heartbeat', async (t) => {
  // Dead after 10 minutes: heartbeats and periodic sweeps every 2 minutes, so a recovery within
  // the test is the sweep due when the heartbeat is old enough, not a periodic one.
  const gateway = await startTestGateway(t, { role: 'api', env: { WORKER_DEAD_AFTER_MS: '600000' } });
  const client = clientFor(gateway.url, await gateway.createKey());
  const accepted = await client.post({ model: 'test-echo', messages: userMessage() });
  const id = accepted.body.id as string;
  // A worker last heard from 595 s ago, due to be found dead 5 s from now, and an attempt it
  // started just now (after that heartbeat, as a worker may until the moment it dies).
  await gateway.pool.query(`insert into gateway.worker_pools (id, hostname, pid, last_seen_at) values ('worker-dying', 'h', 1, now() - interval '595 s')`);
  await gateway.pool.query(`update gateway.requests set status = 'processing', attempts = 1, next_attempt_at = null where id = $1`, [id]);
  await gateway.pool.query(
    `insert into gateway.request_attempts (request_id, attempt_number, worker_id, upstream, started_at) values ($1, 1, 'worker-dying', 'test', now())`,
    [id],
  );
  const insertedAt = Date.now();
  const { service } = await startWorkerIn(t, gateway);

  let recoveredAfterMs = Infinity;
  await waitFor(async () => {
    const [first] = await attemptRows(gateway.db, id);
    if (first?.outcome !== 'failed') return false;
    recoveredAfterMs = Date.now() - insertedAt;
    return true;
  }, 20_000, 50);
  t.comment(`recovered ${recoveredAfterMs} ms after the heartbeat was made 595 s old (due at 5000 ms; the periodic sweeps at about 0 and 120000 ms)`);
  // Within waitFor's 20 s: by the sweep due at that moment, the next periodic one being 2 minutes away.
  t.match(await attemptRows(gateway.db, id), [{ attempt_number: 1, outcome: 'failed', error_code: 'worker_lost', worker_id: 'worker-dying' }], 'its attempt is recorded as worker_lost, by the sweep due at that moment');
  t.ok(recoveredAfterMs >= 4_900, 'not before its heartbeat was 600 s old');
  t.match(await waitForRow(gateway.db, id, isTerminal), { status: 'completed', attempts: 2 }, 'and it completes in a second attempt');
  await service.stop();
});

t.test('a lost attempt recorded by a sweep is attempted again at once by the worker that swept, not on its next poll for jobs', async (t) => {
  // A poll for jobs every hour: the retry's dispatch job, due at the end of its quarter second,
  // is not due yet when its notification comes, and would wait for the next poll, past the test's
  // end. Attempted again within the test, with that job still waiting, is the sweeping worker's
  // own wake-up of the queue.
  const gateway = await startTestGateway(t, { role: 'api', env: { WORKER_POLL_INTERVAL_MS: '3600000' } });
  const client = clientFor(gateway.url, await gateway.createKey());
  const accepted = await client.post({ model: 'test-echo', messages: userMessage() });
  const id = accepted.body.id as string;
  await gateway.pool.query(`update gateway.requests set status = 'processing', attempts = 1, next_attempt_at = null where id = $1`, [id]);
  const { logs } = await startWorkerIn(t, gateway);
  await until(() => logs.some((line) => line.includes('worker pool started')), 'the worker pool started', 15_000);
  // Its first poll is over (it ran the job the request was accepted with): the attempt of a
  // worker gone a minute ago appears now, for a sweep (every 1.4 s, WORKER_DEAD_AFTER_MS being
  // 7 s) to find.
  await until(async () => (await dispatchJobs(gateway.db)).length === 0, 'the first poll to run the job of the request\'s acceptance', 15_000);
  await gateway.pool.query(
    `insert into gateway.request_attempts (request_id, attempt_number, worker_id, upstream, started_at) values ($1, 1, 'worker-gone', 'test', now() - interval '1 minute')`,
    [id],
  );
  const row = await waitForRow(gateway.db, id, isTerminal, 30_000);
  const [first, second] = await attemptRows(gateway.db, id);
  t.match([first, second], [{ outcome: 'failed', error_code: 'worker_lost' }, { outcome: 'succeeded' }], 'recorded as worker_lost, then attempted again');
  t.equal(row.status, 'completed', 'and completed');
  const queueId = await queueOf(gateway.db, id);
  const retryJobs = (await dispatchJobs(gateway.db)).filter((job) => job.queue_id === queueId && job.run_at >= first!.finished_at!);
  t.equal(retryJobs.length, 1, 'by the sweeping worker: the retry\'s dispatch job, the one other way, is still waiting for a poll');
});

t.test('two workers recovering the same lost attempt at once: one records it, counts it and retries it', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  const accepted = await client.post({ model: 'test-echo', messages: userMessage() });
  const id = accepted.body.id as string;
  await gateway.pool.query(`update gateway.requests set status = 'processing', attempts = 1, next_attempt_at = null where id = $1`, [id]);
  await gateway.pool.query(
    `insert into gateway.request_attempts (request_id, attempt_number, worker_id, upstream, started_at) values ($1, 1, 'worker-gone', 'test', now() - interval '1 minute')`,
    [id],
  );
  const logger = createLogger(gateway.config, new Writable({ write: (_chunk, _encoding, done) => done() }));
  const workers = [new Metrics(), new Metrics()].map((metrics) => ({ metrics, attempts: createAttempts({ db: gateway.db, config: gateway.config, metrics, logger }) }));
  t.teardown(() => Promise.all(workers.map((worker) => worker.attempts.close())));

  // Both statements start while a lock holds the attempt's row: both read it as running, and
  // the second to get the lock finds it ended by the first.
  const locker = await gateway.pool.connect();
  await locker.query('begin');
  await locker.query(`select from gateway.request_attempts where request_id = $1 for update`, [id]);
  const lost = [{ id, attempt: 1, mode: 'test' as const, queue_id: (await requestRow(gateway.db, id))!.queue_id, charged: 0 }];
  const recovered = Promise.all(workers.map((worker) => worker.attempts.recover(lost)));
  await until(async () => {
    const { rows } = await gateway.pool.query(
      `select from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock'`,
    );
    return rows.length === 2;
  }, 'both statements waiting for the lock');
  await locker.query('commit');
  locker.release();
  await recovered;

  t.match(await attemptRows(gateway.db, id), [{ attempt_number: 1, outcome: 'failed', error_code: 'worker_lost' }], 'recorded once');
  t.match(await requestRow(gateway.db, id), { status: 'retrying', attempts: 1 }, 'and retried once');
  const counted = await Promise.all(
    workers.map(async ({ metrics }) => parseMetrics(await metrics.render()).get('gateway_attempts_total{mode="test",outcome="failed",code="worker_lost"}') ?? 0),
  );
  t.same(counted.sort(), [0, 1], 'counted by the worker that recorded it, not by the other');
});
