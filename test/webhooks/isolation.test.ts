// One project's webhook endpoint cannot degrade another's deliveries (docs/webhooks.md, "A slow
// endpoint does not hold up the others"): an endpoint that accepts connections and never answers,
// fed 500 events, holds at most WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT tries of the worker, backs off
// once its tries time out, and its waiting events cost a bounded number of graphile-worker jobs,
// not one per event per second; meanwhile another project's healthy endpoint gets its events at
// once. Through the whole gateway: requests accepted by the API and run by the worker in test mode.
import t from 'tap';
import { inBatches } from '../helpers/concurrency.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { until, waitFor } from '../helpers/wait.ts';
import { addTestEndpoint, messagesOf, startReceiver } from './support.ts';

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

// Small enough that, without a cap per endpoint, the silent endpoint's tries would fill every slot.
const MAX_IN_FLIGHT = 50;
const TIMEOUT_MS = 2_000;
const SLOW_EVENTS = 500;
const QUICK_EVENTS = 100;
const QUICK_EVENTS_PER_SECOND = 20;
// Retries that stay due within the test: the silent endpoint's events remain to deliver throughout.
const RETRY_SCHEDULE = '1000,2000,4000,8000,16000,32000';

function tally(values: Iterable<string>): string {
  const counts = new Map<string, number>();
  for (const value of values) counts.set(value, (counts.get(value) ?? 0) + 1);
  return [...counts].sort(([a], [b]) => (a < b ? -1 : 1)).map(([value, n]) => `${value}: ${n}`).join(', ');
}

function percentile(sorted: readonly number[], p: number): number {
  return sorted[Math.min(sorted.length - 1, Math.ceil(p * sorted.length) - 1)]!;
}

t.test(
  `an endpoint that never answers, fed ${SLOW_EVENTS} events, holds at most 10 tries and backs off; another project's events arrive within 2 s (p99); waiting adds a bounded number of jobs`,
  async (t) => {
    const gateway = await startTestGateway(t, {
      env: {
        WEBHOOK_ALLOW_PRIVATE: 'true',
        WEBHOOK_TIMEOUT_MS: String(TIMEOUT_MS),
        WEBHOOK_MAX_IN_FLIGHT: String(MAX_IN_FLIGHT),
        WEBHOOK_RETRY_SCHEDULE: RETRY_SCHEDULE,
      },
    });
    t.equal(gateway.config.webhooks.maxInFlightPerEndpoint, 10, 'WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT: its default');
    // Every graphile-worker job added during the test, by task (jobs are deleted once run).
    // (pool.query without parameters: several statements in one)
    await gateway.pool.query(`
      create table public.jobs_added (task text not null, added_at timestamptz not null default now());
      create function public.count_job_added() returns trigger language plpgsql as $$
      begin
        insert into public.jobs_added (task) select identifier from graphile_worker._private_tasks where id = new.task_id;
        return null;
      end;
      $$;
      create trigger count_jobs_added after insert on graphile_worker._private_jobs
        for each row execute function public.count_job_added();
    `);

    const silent = await startReceiver(t, () => ({ hang: true }));
    const healthy = await startReceiver(t);
    await addTestEndpoint(gateway, { project: 'silent', url: silent.url });
    await addTestEndpoint(gateway, { project: 'healthy', url: healthy.url });
    const silentClient = clientFor(gateway.url, await gateway.createKey({ project: 'silent', mode: 'test' }));
    const healthyClient = clientFor(gateway.url, await gateway.createKey({ project: 'healthy', mode: 'test' }));
    const startedAt = Date.now();

    const flood = await inBatches(Array.from({ length: SLOW_EVENTS }, (_, i) => i), 50, (i) =>
      silentClient.post({ model: 'test-echo', messages: userMessage(`silent ${i}`) }),
    );
    t.equal(tally(flood.map((answer) => String(answer.status))), `202: ${SLOW_EVENTS}`, `the silent project's ${SLOW_EVENTS} requests accepted`);
    await until(() => silent.deliveries.length >= 10, 'the silent endpoint holds its first tries', 10_000);

    // The healthy project's requests, while the silent endpoint holds its tries, then backs off.
    const healthyIds: string[] = [];
    const statuses: string[] = [];
    for (let i = 0; i < QUICK_EVENTS; i++) {
      const due = Date.now() + 1_000 / QUICK_EVENTS_PER_SECOND;
      const answer = await healthyClient.post({ model: 'test-echo', messages: userMessage(`healthy ${i}`) });
      statuses.push(String(answer.status));
      healthyIds.push(answer.body.id as string);
      if (due > Date.now()) await sleep(due - Date.now());
    }
    t.equal(tally(statuses), `202: ${QUICK_EVENTS}`, `the healthy project's ${QUICK_EVENTS} requests accepted, ${QUICK_EVENTS_PER_SECOND} a second`);
    const healthyMessages = async () =>
      (await messagesOf(gateway.db)).filter((message) => healthyIds.includes(message.request_id));
    const allDelivered = await waitFor(
      async () => (await healthyMessages()).length === QUICK_EVENTS && (await healthyMessages()).every((message) => message.status === 'delivered'),
      30_000,
    );
    t.ok(allDelivered, 'every healthy event delivered');

    const firstReceipt = new Map<string, number>();
    for (const delivery of healthy.deliveries) {
      const id = String(delivery.headers['webhook-id']);
      if (!firstReceipt.has(id)) firstReceipt.set(id, delivery.receivedAt);
    }
    // (an event not arrived yet counts as arriving now)
    const delays = (await healthyMessages())
      .map((message) => (firstReceipt.get(message.id) ?? Date.now()) - message.created_at.getTime())
      .sort((a, b) => a - b);
    const p50 = percentile(delays, 0.5);
    const p99 = percentile(delays, 0.99);
    t.comment(`healthy events, from the request's end to their arrival: p50 ${p50} ms, p99 ${p99} ms, max ${delays.at(-1)} ms`);
    t.ok(p99 <= 2_000, `the healthy endpoint's events arrived within 2 s (p99: ${p99} ms)`);

    t.ok(silent.maxOpen <= 10, `the silent endpoint held ${silent.maxOpen} tries at most (WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT: 10)`);
    const silentMessages = (await messagesOf(gateway.db)).filter((message) => !healthyIds.includes(message.request_id));
    t.equal(silentMessages.length, SLOW_EVENTS);
    t.same(
      silentMessages.filter((message) => message.status !== 'pending' && message.status !== 'delivering').map((message) => message.status),
      [],
      `its events all wait, none given up (${tally(silentMessages.map((message) => message.status))})`,
    );
    const silentTries = silentMessages.reduce((sum, message) => sum + message.tries, 0);
    t.equal(silentTries, silent.deliveries.length, 'each try counted reached it: waiting spent none');

    // Jobs: one deliver_webhook per event and per retry after a failed try; anything more, and
    // every wake_webhook_endpoint, is the cost of waiting.
    const { rows: added } = await gateway.pool.query<{ task: string; jobs: number }>(
      `select task, count(*)::int as jobs from public.jobs_added group by task order by task`,
    );
    const jobs = Object.fromEntries(added.map((row) => [row.task, row.jobs]));
    const { rows: failed } = await gateway.pool.query<{ tries: number }>(
      `select count(*)::int as tries from gateway.webhook_deliveries where outcome = 'failed'`,
    );
    const waitingJobs =
      Math.max(0, (jobs.deliver_webhook ?? 0) - SLOW_EVENTS - QUICK_EVENTS - failed[0]!.tries) + (jobs.wake_webhook_endpoint ?? 0);
    const seconds = (Date.now() - startedAt) / 1000;
    t.comment(`over ${seconds.toFixed(1)} s: jobs added ${JSON.stringify(jobs)}; failed tries ${failed[0]!.tries}; silent tries ${silentTries}`);
    t.ok(waitingJobs <= 40, `${waitingJobs} jobs for waiting events over ${seconds.toFixed(1)} s (not one per event per second)`);

    const { rows: endpoint } = await gateway.pool.query(
      `select backoff_ms from gateway.webhook_endpoints join gateway.projects on projects.id = webhook_endpoints.project_id where projects.name = 'silent'`,
    );
    t.ok(endpoint[0].backoff_ms >= 1_000, `the silent endpoint backs off (${endpoint[0].backoff_ms} ms)`);

    // Once it answers, its next probe ends the backoff and its waiting events follow.
    const releasedAt = Date.now();
    silent.release({ status: 204 });
    const silentDelivered = async () =>
      (await messagesOf(gateway.db)).filter((message) => !healthyIds.includes(message.request_id) && message.status === 'delivered').length;
    await until(async () => (await silentDelivered()) === SLOW_EVENTS, "the silent endpoint's events delivered", 30_000);
    t.comment(`the silent endpoint's ${SLOW_EVENTS} events were delivered ${Date.now() - releasedAt} ms after it began to answer`);
    t.equal(new Set(silent.deliveries.map((delivery) => delivery.headers['webhook-id'])).size, SLOW_EVENTS, 'each of its events arrived');
    t.ok(silent.maxOpen <= 10, `at most 10 tries at a time still (${silent.maxOpen})`);
  },
);
