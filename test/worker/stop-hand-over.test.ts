// A worker that stops hands over the dispatches it would have given itself: the queues waiting
// in its memory for room in its MAX_IN_FLIGHT, and the room that its calls ending on a lane with
// max_concurrent leave. Another worker takes them at once, not when the rescue finds them
// (WORKER_DEAD_AFTER_MS is a minute here: the rescue stays out of the way).
import t, { type Test } from 'tap';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { dispatchJobs } from '../helpers/rows.ts';
import { heldUpstream } from '../helpers/upstream.ts';
import { upstreamsFile } from '../helpers/upstreams-file.ts';
import { until } from '../helpers/wait.ts';

const QUIET_RESCUE = { WORKER_DEAD_AFTER_MS: '60000', SHUTDOWN_GRACE_MS: '10000', UPSTREAM_TIMEOUT_MS: '30000' };

/** Accepts `count` requests of `model` on a live key (the API process runs none). */
async function accept(t: Test, api: TestGateway, model: string, count: number): Promise<void> {
  const client = clientFor(api.url, await api.createKey({ mode: 'live' }));
  for (let i = 0; i < count; i++) t.equal((await client.post({ model, messages: userMessage(`n${i}`) })).status, 202, 'accepted');
}

async function completed(api: TestGateway): Promise<number> {
  const { rows } = await api.pool.query(`select count(*)::int as count from gateway.requests where status = 'completed'`);
  return rows[0].count;
}

t.test('the queues waiting for room in a stopping worker are dispatched by another at once', async (t) => {
  const upstream = await heldUpstream(t);
  const env = { ...QUIET_RESCUE, UPSTREAM_BASE_URL: upstream.baseUrl };
  const api = await startTestGateway(t, { role: 'api', env });
  await accept(t, api, 'gpt-x', 3);
  // Room for one call: the other two wait in its memory, their dispatch jobs spent.
  const full = await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env: { ...env, MAX_IN_FLIGHT: '1' } });
  await until(async () => upstream.calls.length === 1 && (await dispatchJobs(api.db)).length === 0, 'one call, and no job left');
  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env });

  const stopped = full.stop();
  await until(() => upstream.calls.length === 3, () => `the other worker to call for the two waiting (${upstream.calls.length} calls)`, 10_000);
  upstream.release();
  await stopped;
  await until(async () => (await completed(api)) === 3, 'all three completed', 10_000);
});

t.test('the room that a stopping worker\'s calls leave on a lane with max_concurrent is taken by another at once', async (t) => {
  const upstream = await heldUpstream(t);
  const file = await upstreamsFile(t, [{ name: 'capped', base_url: upstream.baseUrl, models: ['capped-*'], limits: { max_concurrent: 1 } }]);
  const env = { ...QUIET_RESCUE, UPSTREAMS_FILE: file };
  const api = await startTestGateway(t, { role: 'api', env });
  await accept(t, api, 'capped-x', 3);
  const first = await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env });
  await until(async () => upstream.calls.length === 1 && (await dispatchJobs(api.db)).length === 0, 'one call, and no job left');
  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env });

  // The call ends while its worker stops: the other worker starts the next, one at a time.
  const stopped = first.stop();
  upstream.release();
  await stopped;
  await until(async () => (await completed(api)) === 3, 'all three completed', 10_000);
  t.equal(upstream.peakInFlight(), 1, 'one call at a time');
});
