// Jobs that failed and wait out graphile-worker's backoff (exp(attempts) seconds: 2.5 minutes
// after 5 failures, hours after 9), as a database that refused statements for minutes leaves
// them: the queue or the endpoint they were for does not wait for them once the database is back.
// The rescue (worker/rescue.ts) runs such a job again, at most about once per WORKER_DEAD_AFTER_MS,
// and a message parked for its endpoint's wake (scheduleWake) brings a stalled wake forward.
// The failures are written into graphile-worker's table, as they would be left.
import t from 'tap';
import { scheduleWake } from '../../src/webhooks/delivery-repository.ts';
import { dispatchStranded, wakeStrandedEndpoints } from '../../src/worker/rescue-repository.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { isTerminal, waitForRow } from '../helpers/rows.ts';
import { until } from '../helpers/wait.ts';
import { addTestEndpoint, endRequest, messagesOf, wakeJobs } from '../webhooks/support.ts';
import { accept, eventForReceiver, loseJobs, WEBHOOK_TASKS } from './support.ts';

/** A job's state as graphile-worker reads it. */
interface JobState {
  id: string;
  attempts: number;
  run_at: Date;
  last_error: string | null;
}

/**
 * Makes the jobs `where` picks look as graphile-worker leaves a job that has failed `attempts`
 * times, the last `failedSecondsAgo` seconds ago (its run_at is then exp(attempts) seconds later).
 */
async function failJobs(gateway: TestGateway, where: string, params: unknown[], attempts: number, failedSecondsAgo: number): Promise<JobState[]> {
  const { rows } = await gateway.pool.query<JobState>(
    `update graphile_worker._private_jobs as jobs
     set attempts = ${attempts}, last_error = 'database unavailable',
         run_at = now() - interval '${failedSecondsAgo} seconds' + exp(least(${attempts}, 10)) * interval '1 second'
     where ${where}
     returning jobs.id::text, jobs.attempts, jobs.run_at, jobs.last_error`,
    params,
  );
  return rows;
}

const DISPATCH_JOBS_OF = `task_id = (select id from graphile_worker._private_tasks where identifier = 'dispatch_queue') and payload->>'queue_id' = $1::text`;
const WAKE_JOB_OF = `key = 'wake_webhook_endpoint:' || $1`;

async function jobState(gateway: TestGateway, id: string): Promise<JobState | undefined> {
  const { rows } = await gateway.pool.query<JobState>(`select id::text, attempts, run_at, last_error from graphile_worker._private_jobs where id = $1`, [id]);
  return rows[0];
}

t.test('a queue whose only dispatch waits out a backoff of failures is dispatched; one failed lately, or due within the period, is not', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey({ mode: 'live' });
  const stalled = await accept(gateway, key, 'stalled');
  const lately = await accept(gateway, key, 'lately');
  const soon = await accept(gateway, key, 'soon');
  const paused = await accept(gateway, key, 'paused');
  await gateway.pool.query(`update gateway.requests set next_attempt_at = now() - interval '10 seconds'`);
  // Failed 5 times, the last 20 s ago: due in over 2 minutes.
  const [stalledJob] = await failJobs(gateway, DISPATCH_JOBS_OF, [stalled.queueId], 5, 20);
  // Failed 5 times, the last a second ago: the rescue waits a period before it runs it again.
  await failJobs(gateway, DISPATCH_JOBS_OF, [lately.queueId], 5, 1);
  // Failed 3 times, the last 17 s ago: due in 3 s, within the period.
  await failJobs(gateway, DISPATCH_JOBS_OF, [soon.queueId], 3, 17);
  // Never failed, due in an hour (its lane paused): as it should be.
  await gateway.pool.query(`update graphile_worker._private_jobs set run_at = now() + interval '1 hour' where ${DISPATCH_JOBS_OF}`, [paused.queueId]);

  t.same(await dispatchStranded(gateway.db, 5_000, 100), [{ id: stalled.queueId, mode: 'live' }], 'only the queue whose job stalled');
  const job = await jobState(gateway, stalledJob!.id);
  t.ok(job && job.run_at.getTime() <= Date.now() + 1_000, 'its job due now');
  t.equal(job?.attempts, 5, 'its failures still counted: a job failing every time still runs out of attempts');
  t.same(await dispatchStranded(gateway.db, 5_000, 100), [], 'due now, it covers its queue');
});

t.test('a stalled dispatch another statement holds is passed over, and its queue not counted as rescued until it is run', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const stalled = await accept(gateway, await gateway.createKey({ mode: 'live' }), 'held');
  await gateway.pool.query(`update gateway.requests set next_attempt_at = now() - interval '10 seconds'`);
  const [stalledJob] = await failJobs(gateway, DISPATCH_JOBS_OF, [stalled.queueId], 5, 20);

  // Held, as by another worker's rescue of it, or a worker fetching it.
  const holder = await gateway.pool.connect();
  t.teardown(() => holder.release());
  await holder.query('begin');
  await holder.query('select from graphile_worker._private_jobs where id = $1 for update', [stalledJob!.id]);
  t.same(await dispatchStranded(gateway.db, 5_000, 100), [], 'not rescued: its job was not made due');
  t.equal((await jobState(gateway, stalledJob!.id))?.run_at.getTime(), stalledJob!.run_at.getTime(), 'its job as it was');
  await holder.query('rollback');

  t.same(await dispatchStranded(gateway.db, 5_000, 100), [{ id: stalled.queueId, mode: 'live' }], 'once let go, rescued');
});

t.test('a worker runs a request whose queue\'s dispatch waits out a backoff of failures', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const { id, queueId } = await accept(api, await api.createKey(), 'test-echo');
  // The database refused the job's statements for minutes: 5 failures, the last 2 s ago.
  t.ok((await failJobs(api, DISPATCH_JOBS_OF, [queueId], 5, 2)).length > 0, 'its dispatch job failed');

  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env: { WORKER_DEAD_AFTER_MS: '1000' } });
  const row = await waitForRow(api.db, id, isTerminal, 15_000);
  t.equal(row.status, 'completed', 'the request ran');
});

t.test('an endpoint whose wake waits out a backoff of failures is woken; one failed lately is not', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const url = 'http://127.0.0.1:9/hooks';
  const [stalled, lately] = await Promise.all([addTestEndpoint(gateway, { url }), addTestEndpoint(gateway, { url })]);
  await endRequest(gateway, key, 'completed');
  await loseJobs(gateway, WEBHOOK_TASKS);
  await gateway.pool.query(`update gateway.webhook_messages set next_try_at = now() - interval '10 seconds'`);
  for (const endpoint of [stalled!, lately!]) {
    await gateway.pool.query(`select graphile_worker.add_job('wake_webhook_endpoint', json_build_object('endpoint_id', $1::text, 'deferrals', 2), job_key => 'wake_webhook_endpoint:' || $1)`, [endpoint.id]);
  }
  const [stalledJob] = await failJobs(gateway, WAKE_JOB_OF, [stalled!.id], 5, 20);
  await failJobs(gateway, WAKE_JOB_OF, [lately!.id], 5, 1);

  t.same(await wakeStrandedEndpoints(gateway.db, 5_000, 100), [stalled!.id], 'only the endpoint whose wake stalled');
  const job = await jobState(gateway, stalledJob!.id);
  t.ok(job && job.run_at.getTime() <= Date.now() + 1_000, 'its wake due now');
  t.equal(job?.attempts, 5, 'its failures still counted');
  t.equal((await wakeJobs(gateway.db)).length, 2, 'no other wake job added');
  t.same(await wakeStrandedEndpoints(gateway.db, 5_000, 100), [], 'due now, it covers its endpoint');
});

t.test('a worker delivers a message whose endpoint\'s wake waits out a backoff of failures', async (t) => {
  const { api, receiver, endpoint, requestId } = await eventForReceiver(t);
  // Its message parked for the endpoint's wake, which then failed 5 times, the last 2 s ago.
  await loseJobs(api, WEBHOOK_TASKS);
  await api.pool.query(`select graphile_worker.add_job('wake_webhook_endpoint', json_build_object('endpoint_id', $1::text, 'deferrals', 0), job_key => 'wake_webhook_endpoint:' || $1)`, [endpoint.id]);
  await failJobs(api, WAKE_JOB_OF, [endpoint.id], 5, 2);

  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env: { WORKER_DEAD_AFTER_MS: '1000', WEBHOOK_ALLOW_PRIVATE: 'true' } });
  await until(() => receiver.deliveries.length === 1, 'the message to be delivered', 15_000);
  t.equal(receiver.deliveries[0]!.event?.data.id, requestId, 'its event delivered');
  await until(async () => (await messagesOf(api.db, requestId))[0]!.status === 'delivered', 'the message to be recorded delivered', 10_000);
});

t.test('a message parked for its endpoint\'s wake brings forward a wake that waits out a backoff of failures', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const url = 'http://127.0.0.1:9/hooks';
  const [stalled, paused] = await Promise.all([addTestEndpoint(gateway, { url }), addTestEndpoint(gateway, { url })]);
  // One message for each endpoint, due now, with none of its jobs.
  const requestId = await endRequest(gateway, await gateway.createKey(), 'completed');
  const messages = await messagesOf(gateway.db, requestId);
  await loseJobs(gateway, WEBHOOK_TASKS);
  // A wake that failed 5 times, the last 2 s ago; a wake that never failed, due in an hour.
  await gateway.pool.query(`select graphile_worker.add_job('wake_webhook_endpoint', json_build_object('endpoint_id', $1::text, 'deferrals', 0), job_key => 'wake_webhook_endpoint:' || $1)`, [stalled!.id]);
  await failJobs(gateway, WAKE_JOB_OF, [stalled!.id], 5, 2);
  await gateway.pool.query(`select graphile_worker.add_job('wake_webhook_endpoint', json_build_object('endpoint_id', $1::text, 'deferrals', 3), run_at => now() + interval '1 hour', job_key => 'wake_webhook_endpoint:' || $1)`, [paused!.id]);

  for (const endpoint of [stalled!, paused!]) {
    const message = messages.find((row) => row.endpoint_id === endpoint.id)!;
    t.equal(await scheduleWake(gateway.db, { endpointId: endpoint.id, delayMs: 0, deferrals: 0, messageId: message.id }), true, 'its message waits');
  }
  const wakes = await wakeJobs(gateway.db);
  t.equal(wakes.length, 2, 'one wake per endpoint');
  const runAt = (endpointId: string) => wakes.find((job) => job.endpoint_id === endpointId)!.run_at.getTime();
  t.ok(runAt(stalled!.id) <= Date.now() + 1_000, 'the stalled wake is due now');
  t.ok(runAt(paused!.id) > Date.now() + 30 * 60_000, 'a wake that never failed keeps its time');
});
