// The making of a route's lanes (ensureLanes), whose deployments come in the order they are
// preferred, and the claim (gateway.claim_queue), which first takes its deployment from a lane the
// worker's configuration no longer lists, lock the lanes in the order of their ids, as the
// recording of attempts' ends (attempts-repository.ts) locks them: none of them waits for another
// in a circle.
import t, { type Test } from 'tap';
import { createDb, createPool, type Db } from '../../src/db/pool.ts';
import { claimQueue, ensureLanes } from '../../src/lanes/repository.ts';
import { NO_LIMITS } from '../../src/upstream/upstreams.ts';
import { LANE_HEALTH } from '../../src/lanes/health.ts';
import { createLogger } from '../../src/logger.ts';
import { finishAttempts, type Finish } from '../../src/worker/attempts-repository.ts';
import { testDatabasePool } from '../helpers/database.ts';
import { plantRunning } from '../helpers/populate.ts';
import { waitingOnLock } from '../helpers/rows.ts';
import { until } from '../helpers/wait.ts';

/** A pool of its own to the test's database, named so that its waits can be told apart. */
function poolOf(t: Test, url: string, applicationName: string): Db {
  const pool = createPool(url, { max: 1, applicationName, logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  return createDb(pool);
}

/**
 * Two lanes of queue 'm' (primary's id the lower), each with a request running on it, a failure
 * of each to record, and a request queued (so that a claim has something to do).
 */
async function twoBusyLanes(t: Test) {
  const { url, pool } = await testDatabasePool(t, 'lane-lock-order-test', 3);
  const recorder = poolOf(t, url, 'lane-lock-order-recorder');
  const router = poolOf(t, url, 'lane-lock-order-router');
  const { queueId, laneId: primary } = await plantRunning(pool, { project: 'locks', ids: ['req_lockingLockingLocking01'] });
  const { rows: [second] } = await pool.query<{ id: string }>(
    `insert into gateway.lanes (mode, upstream, model, queue_id, deployment) values ('live', 'secondary', 'm', $1, 2) returning id::text`,
    [queueId],
  );
  const secondary = second!.id;
  await pool.query(
    `insert into gateway.requests (id, project_id, mode, api_key_id, status, attempts, model, body, body_sha256, queue_id, lane_id)
     select 'req_lockingLockingLocking02', project_id, mode, api_key_id, status, attempts, model, body, body_sha256, queue_id, $1
     from gateway.requests where id = 'req_lockingLockingLocking01'`,
    [secondary],
  );
  await pool.query(`insert into gateway.request_attempts (request_id, attempt_number, worker_id, upstream) values ('req_lockingLockingLocking02', 1, 'w', 'secondary')`);

  // A failure on each lane: recorded by the statement that locks the group's lanes.
  const failures: Finish[] = ['req_lockingLockingLocking01', 'req_lockingLockingLocking02'].map((id) => ({
    kind: 'retry', id, attempt: 1, delayMs: 1000, unchargedDelayMs: 1000,
    code: 'upstream_error', fault: 'upstream', detail: 'HTTP 500', upstreamStatus: 500, durationMs: 5,
  }));

  await pool.query(
    `insert into gateway.requests (id, project_id, mode, api_key_id, status, attempts, model, body, body_sha256, queue_id, next_attempt_at)
     select 'req_lockingLockingLocking03', project_id, mode, api_key_id, 'queued', 0, model, body, body_sha256, queue_id, now()
     from gateway.requests where id = 'req_lockingLockingLocking01'`,
  );
  t.ok(BigInt(primary) < BigInt(secondary));
  // primary's row held by a transaction of the test's, until it lets it go.
  const locker = await pool.connect();
  t.teardown(() => locker.release());
  await locker.query('begin');
  await locker.query('select from gateway.lanes where id = $1 for update', [primary]);
  const recording = finishAttempts(recorder, failures, { maxAttempts: 5, health: LANE_HEALTH });
  await until(async () => (await waitingOnLock(pool, 'lane-lock-order-recorder')) === 1, 'the recording to wait for primary');
  return { pool, router, queueId, primary, secondary, recording, release: () => locker.query('commit') };
}

t.test("a route's lanes made again while a recording locks them: both end, neither a deadlock's victim", async (t) => {
  const { pool, router, queueId, primary, secondary, recording, release } = await twoBusyLanes(t);
  // The recording waits for primary (holding no lane); the route, which prefers secondary, would
  // take secondary and wait for primary too, were it not to lock them in the order of their ids.
  const routing = ensureLanes(router, { id: queueId, mode: 'live', model: 'm' }, ['secondary', 'primary']);
  await until(async () => (await waitingOnLock(pool, 'lane-lock-order-router')) === 1, 'the route to wait for a lane');
  await release();

  const [recorded, routed] = await Promise.allSettled([recording, routing]);
  t.equal(recorded.status === 'rejected' ? String(recorded.reason) : 'fulfilled', 'fulfilled', 'the recording ends');
  t.equal(routed.status === 'rejected' ? String(routed.reason) : 'fulfilled', 'fulfilled', 'the route is made');
  if (routed.status === 'fulfilled') t.same(routed.value, [secondary, primary], "the route's lanes, in its order");
  if (recorded.status === 'fulfilled') t.same(recorded.value.finished.map((finished) => finished?.status), ['retrying', 'retrying']);
});

t.test('a claim by a worker whose configuration lists one lane of two, while a recording locks them: both end', async (t) => {
  const { pool, router, queueId, primary, secondary, recording, release } = await twoBusyLanes(t);
  // The claim takes secondary's deployment (this worker's configuration lists primary alone), which
  // would lock secondary before it waits for primary, were it not to lock them in the order of their ids.
  const claiming = claimQueue(router, queueId, 1, 'w2', [{ laneId: primary, limits: NO_LIMITS }]);
  await until(async () => (await waitingOnLock(pool, 'lane-lock-order-router')) === 1, 'the claim to wait for a lane');
  await release();

  const [recorded, claimed] = await Promise.allSettled([recording, claiming]);
  t.equal(recorded.status === 'rejected' ? String(recorded.reason) : 'fulfilled', 'fulfilled', 'the recording ends');
  t.equal(claimed.status === 'rejected' ? String(claimed.reason) : 'fulfilled', 'fulfilled', 'the claim ends');
  const { rows } = await pool.query<{ id: string; deployment: number | null }>(
    'select id::text, deployment from gateway.lanes where queue_id = $1 order by id',
    [queueId],
  );
  t.same(rows.map((row) => [row.id, row.deployment === null]), [[primary, false], [secondary, true]], "secondary's deployment taken");
});
