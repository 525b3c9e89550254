// Outage 11: the only upstream of a model accepts calls and never answers them (its gateway's
// UPSTREAM_TIMEOUT_MS is two minutes), and the gateway is restarted (stopped as on SIGTERM, then
// started again on the same database) six times while a request's call hangs there. Each stop
// aborts the call once its grace is over and records the attempt as worker_lost: the operator's
// restart, not the request's fault, so none of them is charged and the request is not failed for
// them. Once the upstream answers again, it completes.
import t from 'tap';
import { tally } from '../faults/support/client.ts';
import { waitUntilTerminal } from '../faults/support/rows.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';
import { DEFAULT_RETRIES, lifecycleProblems, MAX_ATTEMPTS, MODEL, outageReply, post, requestsWithAttempts, writeUpstreamsFile } from './support.ts';

const RESTARTS = MAX_ATTEMPTS + 1;

t.test('restarted six times while the upstream hangs its call: the request is not failed for the restarts, and completes once the upstream answers', async (t) => {
  const upstream = await startFakeUpstream(t, outageReply({ kind: 'hang' }));
  const file = await writeUpstreamsFile(t, [{ name: 'primary', base_url: upstream.baseUrl, models: [MODEL] }]);
  const env = { ...DEFAULT_RETRIES, UPSTREAMS_FILE: file, UPSTREAM_TIMEOUT_MS: '120000' };
  let gateway: TestGateway = await startTestGateway(t, { env });
  const { databaseUrl } = gateway;
  const key = await gateway.createKey({ project: 'outages-restarts', mode: 'live' });
  const accepted = await post(gateway.url, key, 'a request whose call hangs through restarts');
  t.equal(accepted.status, 202, 'acknowledged');
  const id = accepted.body?.id as string;

  const attemptRunning = async (attempt: number) =>
    (await gateway.pool.query(`select from gateway.request_attempts where request_id = $1 and attempt_number = $2 and outcome = 'running'`, [id, attempt]))
      .rowCount === 1 && upstream.calls.length >= attempt;
  const ended = async () => (await gateway.pool.query(`select from gateway.requests where id = $1 and finished_at is not null`, [id])).rowCount === 1;
  for (let restart = 1; restart <= RESTARTS; restart++) {
    await until(async () => (await attemptRunning(restart)) || (await ended()), `attempt ${restart} to be running, its call at the upstream`, 30_000);
    if (await ended()) break;
    await gateway.stop();
    gateway = await startTestGateway(t, { env, databaseUrl });
  }
  const [waiting] = await requestsWithAttempts(gateway.pool, [id]);
  t.not(waiting?.status, 'failed', `after ${RESTARTS} restarts, the request is not failed (${waiting?.status}, ${waiting?.last_error_code}, ${waiting?.charged_attempts} charged)`);
  t.equal(
    tally(waiting?.attempt_rows.slice(0, RESTARTS).map((attempt) => `${attempt.error_code} charged ${attempt.charged}`) ?? []),
    `worker_lost charged false: ${RESTARTS}`,
    'each call cut short by a restart is recorded as worker_lost, not charged',
  );

  // The call under way now hangs on; the one after the next restart meets the upstream back.
  upstream.replyWith(outageReply({ kind: 'healthy' }));
  // (Its retry waits out the backoff after its sixth attempt, up to 32 s with RETRY_BASE_MS of 1 s.)
  await until(() => attemptRunning(RESTARTS + 1), 'the next attempt to be running', 60_000);
  await gateway.stop();
  gateway = await startTestGateway(t, { env, databaseUrl });
  t.ok((await waitUntilTerminal(gateway.pool, [id], 30_000)).done, 'it ended');
  const [request] = await requestsWithAttempts(gateway.pool, [id]);
  t.match(request, { status: 'completed', charged_attempts: 0, last_error_code: 'worker_lost' }, 'completed, nothing charged');
  t.same(request ? lifecycleProblems(request) : ['not stored'], [], 'its rows keep the rules');
});
