// Jobs that used up their attempts ("spent": graphile-worker keeps such a job's row for good, and
// runs it no more): a worker deletes them, says so in its log and counts them, and what they were
// for still ends, the rescue (worker/rescue.ts) taking it over.
import { parseCrontab } from 'graphile-worker';
import t from 'tap';
import { CRONTAB } from '../../src/worker/runner.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { send } from '../helpers/http.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { until } from '../helpers/wait.ts';
import { messagesOf } from '../webhooks/support.ts';
import { eventForReceiver } from './support.ts';

t.test('a job that used up its attempts is deleted, logged and counted, and its webhook event is still delivered', async (t) => {
  const { api, receiver, endpoint, requestId } = await eventForReceiver(t);
  const [message] = await messagesOf(api.db, requestId);
  // A row the message's claim cannot get past: a try numbered as its next one, already recorded.
  // Every claim of the message fails (a duplicate key), and every job that claims it throws.
  await api.pool.query(`insert into gateway.webhook_deliveries (message_id, try_number, outcome, finished_at) values ($1, 1, 'failed', now())`, [message!.id]);
  // Its deliver_webhook job on its last attempt, as 24 failures would leave it (graphile-worker's
  // backoff spreads them over days).
  const { rows: [job] } = await api.pool.query<{ id: string; max_attempts: number }>(`
    update graphile_worker._private_jobs set attempts = max_attempts - 1
    where task_id = (select id from graphile_worker._private_tasks where identifier = 'deliver_webhook')
    returning id::text, max_attempts`);
  const jobExists = async () => (await api.pool.query(`select from graphile_worker._private_jobs where id = $1`, [job!.id])).rowCount === 1;

  const worker = await startTestGateway(t, {
    role: 'worker',
    databaseUrl: api.databaseUrl,
    env: { WORKER_DEAD_AFTER_MS: '1000', PRUNE_IDLE_QUEUES_AFTER: '2s', METRICS_PORT: '0', WEBHOOK_ALLOW_PRIVATE: 'true' },
  });
  const logged = () => worker.logs.map((line) => JSON.parse(line));
  await until(
    () => logged().some((line) => line.component === 'graphile-worker' && String(line.msg).includes(`attempt ${job!.max_attempts} of ${job!.max_attempts}`)),
    'the job to fail its last attempt',
    15_000,
  );
  // It cannot have ended otherwise: its every run throws.
  await until(async () => !(await jobExists()), 'the spent job to be deleted', 15_000);
  t.match(
    logged().filter((line) => line.component === 'jobs'),
    [{ level: 'warn', msg: 'jobs that used up their attempts deleted', jobs: [{ id: job!.id, task: 'deliver_webhook', attempts: job!.max_attempts, lastError: /duplicate key/ }] }],
    'logged, with its task and its last error',
  );
  const metrics = parseMetrics((await send(worker.metricsUrl, { path: '/metrics' })).text);
  t.equal(metrics.get('gateway_spent_jobs_deleted_total{task="deliver_webhook"}'), 1, 'counted');

  // The cause gone, the message is delivered: the rescue wakes its endpoint, whose wake claims it.
  await api.pool.query(`delete from gateway.webhook_deliveries where message_id = $1`, [message!.id]);
  await until(() => receiver.deliveries.length === 1, 'the message to be delivered', 30_000);
  t.equal(receiver.deliveries[0]!.event?.data.id, requestId, 'its event delivered, and verified');
  await until(async () => (await messagesOf(api.db, requestId))[0]!.status === 'delivered', 'the message to be recorded delivered', 10_000);
});

t.test('the crontab gives each periodic task\'s runs 3 attempts (?max=3), not graphile-worker\'s 25', async (t) => {
  const items = parseCrontab(CRONTAB);
  t.same(items.map((item) => item.task).sort(), ['cleanup_signature_nonces', 'retention'], 'both periodic tasks');
  for (const item of items) t.equal(item.options.maxAttempts, 3, `${item.task}: its jobs' max_attempts`);
});
