// The making of a route's lanes (ensureLanes), whose deployments come in the order they are
// preferred, locks the lanes there in the order of their ids, as the recording of attempts' ends
// (attempts-repository.ts) and the claim (gateway.claim_queue) lock them: none of them waits for
// another in a circle.
import t, { type Test } from 'tap';
import { createDb, createPool, type Db } from '../../src/db/pool.ts';
import { ensureLanes } from '../../src/lanes/repository.ts';
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

t.test("a route's lanes made again while a recording locks them: both end, neither a deadlock's victim", async (t) => {
  const { url, pool } = await testDatabasePool(t, 'lane-lock-order-test', 3);
  const recorder = poolOf(t, url, 'lane-lock-order-recorder');
  const router = poolOf(t, url, 'lane-lock-order-router');
  // Two lanes of queue 'm', primary's id the lower, each with a request running on it.
  const { queueId, laneId: primary } = await plantRunning(pool, { project: 'locks', ids: ['req_lockingLockingLocking01'] });
  const { rows: [second] } = await pool.query<{ id: string }>(
    `insert into gateway.lanes (mode, upstream, model, queue_id) values ('live', 'secondary', 'm', $1) returning id::text`,
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
  t.ok(BigInt(primary) < BigInt(secondary));

  // A failure on each lane: recorded by the statement that locks the group's lanes.
  const failures: Finish[] = ['req_lockingLockingLocking01', 'req_lockingLockingLocking02'].map((id) => ({
    kind: 'retry', id, attempt: 1, delayMs: 1000, unchargedDelayMs: 1000,
    code: 'upstream_error', fault: 'upstream', detail: 'HTTP 500', upstreamStatus: 500, durationMs: 5,
  }));

  // primary's row held here: the recording waits for it first (holding no lane), then the route,
  // which prefers secondary, takes secondary and waits for primary too.
  const locker = await pool.connect();
  t.teardown(() => locker.release());
  await locker.query('begin');
  await locker.query('select from gateway.lanes where id = $1 for update', [primary]);
  const recording = finishAttempts(recorder, failures, { maxAttempts: 5, health: LANE_HEALTH });
  await until(async () => (await waitingOnLock(pool, 'lane-lock-order-recorder')) === 1, 'the recording to wait for primary');
  const routing = ensureLanes(router, { id: queueId, mode: 'live', model: 'm' }, ['secondary', 'primary']);
  await until(async () => (await waitingOnLock(pool, 'lane-lock-order-router')) === 1, 'the route to wait for a lane');
  await locker.query('commit');

  const [recorded, routed] = await Promise.allSettled([recording, routing]);
  t.equal(recorded.status === 'rejected' ? String(recorded.reason) : 'fulfilled', 'fulfilled', 'the recording ends');
  t.equal(routed.status === 'rejected' ? String(routed.reason) : 'fulfilled', 'fulfilled', 'the route is made');
  if (routed.status === 'fulfilled') t.same(routed.value, [secondary, primary], "the route's lanes, in its order");
  if (recorded.status === 'fulfilled') t.same(recorded.value.finished.map((finished) => finished?.status), ['retrying', 'retrying']);
});
