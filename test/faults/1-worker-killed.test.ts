// Fault 1: the worker process is killed with SIGKILL in the middle of its attempts, with 500
// requests in flight, while another worker stands by, and started again. Every request must end,
// each attempted again within 10 s of the kill (with the default WORKER_DEAD_AFTER_MS), the lost
// attempts recorded as worker_lost, and none run once it has ended. The worker standing by is
// how the bound is met in production (a live worker's sweep finds the dead one): a worker
// started after the kill finds it as soon as it is up, which a busy machine can delay by seconds.
// Then a --role all process is killed with wait=true requests in it, and only a worker started
// after the kill recovers them.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { inBatches } from '../helpers/concurrency.ts';
import { parseLine } from '../helpers/serve.ts';
import { completionAfter, startFakeUpstream } from '../helpers/upstream.ts';
import { call, spread, tally } from './support/client.ts';
import { faultContext } from './support/context.ts';
import { dispatchJobs } from '../helpers/rows.ts';
import { waitFor } from '../helpers/wait.ts';
import { countWhere, lifecycleProblems, queueSummary, requestsWithAttempts, waitUntilTerminal } from './support/rows.ts';
import { privateContent } from './support/run.ts';

const REQUESTS = 500;
const MAX_ATTEMPTS = 5;
const RECOVERY_BOUND_MS = 10_000;
// What a worker logs once it has recorded an attempt lost with its worker (src/worker/attempts.ts).
const LOST_RECORDED = 'attempt lost with its worker; recorded, and retried if it may be';

t.test('500 requests in flight, the worker killed with SIGKILL mid-attempt while another stands by, and restarted: all end, each recovered within 10 s, none run after it ended', async (t) => {
  // The provider holds every call until the kill, and answers at once after it.
  const upstream = await startFakeUpstream(t, () => ({ hang: true }));
  const faults = await faultContext(t, '1-worker-killed');
  const env = {
    UPSTREAM_BASE_URL: upstream.baseUrl,
    MAX_IN_FLIGHT: String(REQUESTS),
    WORKER_CONCURRENCY: '100',
    WORKER_POOL_SIZE: '10',
    MAX_ATTEMPTS: String(MAX_ATTEMPTS),
    // Only the kill may end the calls held.
    UPSTREAM_TIMEOUT_MS: '120000',
  };
  const api = await faults.start('api', { env });
  const key = await faults.createKey({ project: 'faults-worker-killed', mode: 'live' });

  // Every request is accepted before any worker runs: all 500 are in flight at the kill.
  const accepted = await inBatches(Array.from({ length: REQUESTS }, (_, i) => i), 25, (i) =>
    call(api.url!, {
      path: '/v1/chat/completions',
      key,
      body: { model: 'gpt-killed', messages: [{ role: 'user', content: privateContent(`scenario 1 request ${i}`) }] },
    }),
  );
  t.same(tally(accepted.map((answer) => answer.status)), `202: ${REQUESTS}`, 'all 500 acknowledged');
  const ids = accepted.map((answer) => answer.body.id as string);

  const worker = await faults.start('worker', { env });
  const busy = await waitFor(() => upstream.calls.length >= REQUESTS, 60_000);
  t.ok(busy, `the worker has all ${REQUESTS} calls under way (${upstream.calls.length})`);
  const standby = await faults.start('worker', { label: 'worker-standby', env });
  const { rows: owners } = await faults.pool.query<{ worker_id: string }>(
    `select distinct worker_id from gateway.request_attempts where outcome = 'running'`,
  );
  t.equal(owners.length, 1, 'all in the first worker: the one standing by has none');
  const standbyPid = standby.pid;

  const killedAt = Date.now();
  const exit = await worker.kill('SIGKILL');
  t.equal(exit?.signal, 'SIGKILL', 'the worker died of SIGKILL');
  upstream.replyWith(completionAfter(0));
  // Statements the dead process had already sent may still commit; let them.
  await sleep(500);
  const { rows: lost } = await faults.pool.query<{ request_id: string; attempt_number: number; worker_id: string }>(
    `select request_id, attempt_number, worker_id from gateway.request_attempts where outcome = 'running'`,
  );
  const terminalAtKill = await countWhere(faults.pool, `status in ('completed', 'failed')`);
  const deadWorkers = new Set(lost.map((attempt) => attempt.worker_id));
  t.ok(lost.length > 0, 'attempts were under way when the worker died');
  t.comment(`killed the worker with ${lost.length} attempts under way; ${terminalAtKill} of ${REQUESTS} requests had ended before the kill`);

  const { rows: beats } = await faults.pool.query<{ last_seen_at: Date }>(
    `select last_seen_at from gateway.worker_pools where id = any($1::text[])`,
    [[...deadWorkers]],
  );
  const lastBeat = Math.max(...beats.map((row) => row.last_seen_at.getTime()));

  const restarted = await faults.start('worker', { label: 'worker-restarted', env });
  const restartedAfterMs = Date.now() - killedAt;
  const outcome = await waitUntilTerminal(faults.pool, ids, 60_000);
  const allEndedAfterMs = Date.now() - killedAt;
  t.ok(outcome.done, `all 500 requests ended (left: ${outcome.left}, by status: ${JSON.stringify(outcome.byStatus)})`);
  t.comment(`all ended ${allEndedAfterMs} ms after the kill (or gave up waiting, with ${outcome.left} left)`);
  if (!outcome.done) t.comment(await queueSummary(faults.pool));
  const atEnd = await requestsWithAttempts(faults.pool, ids);

  // Time for a stray job to run a request again, were there one.
  await sleep(2_000);
  const requests = await requestsWithAttempts(faults.pool, ids);
  t.equal(requests.length, REQUESTS, 'every acknowledged id is stored');

  const problems = requests.flatMap((request) =>
    lifecycleProblems(request, MAX_ATTEMPTS).map((problem) => `${request.id}: ${problem}`),
  );
  t.same(problems.slice(0, 20), [], 'every request completed or failed by the rules: attempts counted, one success per completion, none started after it ended');
  t.same(tally(requests.map((request) => request.status)), `completed: ${REQUESTS}`, 'all completed');

  const lostNow = lost.map((attempt) => {
    const request = requests.find((row) => row.id === attempt.request_id);
    return { attempt, row: request?.attempt_rows.find((row) => row.attempt_number === attempt.attempt_number), request };
  });
  t.same(
    lostNow.filter(({ row }) => row?.outcome !== 'failed' || row.error_code !== 'worker_lost').map(({ attempt, row }) => ({
      request: attempt.request_id,
      attempt: attempt.attempt_number,
      outcome: row?.outcome,
      error_code: row?.error_code,
    })).slice(0, 20),
    [],
    `each of the ${lost.length} lost attempts is recorded as failed with worker_lost`,
  );
  t.same(
    lostNow.filter(({ attempt, request }) => (request?.attempts ?? 0) <= attempt.attempt_number).map(({ attempt }) => attempt.request_id).slice(0, 20),
    [],
    'and each was followed by another attempt',
  );

  // Recovery: how long after the kill each request's next attempt started, on a live worker.
  const recovery: number[] = [];
  const unrecovered: string[] = [];
  for (const request of requests) {
    if (request.finished_at && request.finished_at.getTime() <= killedAt) continue;
    const next = request.attempt_rows.find(
      (attempt) => attempt.started_at.getTime() >= killedAt && !deadWorkers.has(attempt.worker_id ?? ''),
    );
    if (next) recovery.push(next.started_at.getTime() - killedAt);
    else unrecovered.push(request.id);
  }
  const lostRecovery = lost.flatMap((attempt) => {
    const request = requests.find((row) => row.id === attempt.request_id);
    const next = request?.attempt_rows.find((row) => row.attempt_number === attempt.attempt_number + 1);
    return next ? [next.started_at.getTime() - killedAt] : [];
  });
  t.same(unrecovered.slice(0, 20), [], 'every request in flight at the kill was attempted again');
  t.same(recovery.filter((ms) => ms > RECOVERY_BOUND_MS), [], `each within ${RECOVERY_BOUND_MS / 1000} s of the kill`);
  t.comment(`next attempt after the kill (WORKER_DEAD_AFTER_MS at its default), all ${recovery.length} requests in flight: ${spread(recovery)}`);
  t.comment(`next attempt after the kill, the ${lost.length} whose attempt was lost: ${spread(lostRecovery)}`);
  // Where the time went: the dead worker's last heartbeat (it is presumed dead WORKER_DEAD_AFTER_MS
  // later), and the sweep recording the lost attempts.
  const recorded = lostNow.flatMap(({ row }) => (row?.finished_at ? [row.finished_at.getTime() - killedAt] : []));
  t.comment(
    `the dead worker's last heartbeat ${beats.length > 0 ? `${killedAt - lastBeat} ms before the kill` : 'not found'}; ` +
      `the lost attempts recorded as worker_lost after it: ${spread(recorded)} (the killed worker started again ${restartedAfterMs} ms after it)`,
  );
  // From the live workers' logs: when each recording of a lost attempt had committed (the rows
  // above carry when its statement began), and what else they warned of after the kill.
  for (const live of [standby, restarted]) {
    const entries = live.lines.flatMap((line) => {
      const entry = parseLine(line);
      const at = typeof entry?.time === 'string' ? Date.parse(entry.time) : NaN;
      return entry && at >= killedAt ? [{ msg: entry.msg, level: Number(entry.level), at }] : [];
    });
    const committed = entries.filter((entry) => entry.msg === LOST_RECORDED).map((entry) => entry.at - killedAt);
    const warnings = tally(entries.filter((entry) => entry.level >= 40 && entry.msg !== LOST_RECORDED).map((entry) => String(entry.msg)));
    t.comment(`${live.label}: recorded ${committed.length} lost attempts, committed ${spread(committed)} after the kill; its other warnings: ${warnings}`);
  }
  const standbyPrefix = `-${standbyPid}-`;
  const byWorker = tally(requests.flatMap((request) =>
    request.attempt_rows.filter((row) => row.attempt_number > 1).map((row) => (row.worker_id?.includes(standbyPrefix) ? 'standing by' : 'restarted')),
  ));
  t.comment(`the attempts after the kill, by worker: ${byWorker}`);
  t.comment(`attempts per request: ${tally(requests.map((request) => request.attempts))}; last_error_code: ${tally(requests.map((request) => request.last_error_code ?? 'null'))}`);

  t.equal((await dispatchJobs(faults.db)).length, 0, 'no dispatch_queue job is left behind, locked or not');

  const attemptsAtEnd = new Map(atEnd.map((request) => [request.id, request.attempt_rows.length]));
  t.same(
    requests.filter((request) => request.attempt_rows.length !== attemptsAtEnd.get(request.id)).map((request) => request.id),
    [],
    'no ended request was attempted again (in the 2 s after all had ended)',
  );

  await faults.finish(t);
});

const ALL_REQUESTS = 200;
const DEAD_AFTER_MS = 3_000;
const ALL_RECOVERY_BOUND_MS = 15_000;

t.test('a --role all process killed with 200 wait=true requests running in it: each recovered as worker_lost by the sweep of a new worker, all completed', async (t) => {
  const faults = await faultContext(t, '1-all-killed');
  const env = {
    MAX_ATTEMPTS: String(MAX_ATTEMPTS),
    // A worker not heard from for this long is presumed dead, and its attempts recovered.
    WORKER_DEAD_AFTER_MS: String(DEAD_AFTER_MS),
    WAIT_TIMEOUT_MS: '60000',
    UPSTREAM_TIMEOUT_MS: '10000',
  };
  const all = await faults.start('all', { env });
  const key = await faults.createKey({ project: 'faults-all-killed', mode: 'test' });
  const waits = Array.from({ length: ALL_REQUESTS }, (_, i) =>
    call(all.url!, {
      path: '/v1/chat/completions',
      key,
      body: {
        model: 'test-delay-5000',
        messages: [{ role: 'user', content: privateContent(`scenario 1b request ${i}`) }],
        wait: true,
      },
      timeoutMs: 30_000,
    }),
  );
  const stored = await waitFor(async () => (await countWhere(faults.pool, `status = 'processing'`)) >= ALL_REQUESTS, 30_000);
  t.ok(stored, `all ${ALL_REQUESTS} stored and running`);
  const { rows: running } = await faults.pool.query<{ request_id: string; worker_id: string }>(
    `select request_id, worker_id from gateway.request_attempts where outcome = 'running'`,
  );
  t.equal(new Set(running.map((attempt) => attempt.worker_id)).size, 1, 'all in the one process that accepted them');

  const killedAt = Date.now();
  const exit = await all.kill('SIGKILL');
  t.equal(exit?.signal, 'SIGKILL', 'the process died of SIGKILL');
  const answers = await Promise.all(waits);
  t.same(tally(answers.map((answer) => answer.status)), `0: ${ALL_REQUESTS}`, 'no client was answered: the connections died with it');

  await faults.start('worker', { env });
  const ids = running.map((attempt) => attempt.request_id);
  const outcome = await waitUntilTerminal(faults.pool, ids, 60_000);
  t.ok(outcome.done, `all ended (left: ${outcome.left}, by status: ${JSON.stringify(outcome.byStatus)})`);
  if (!outcome.done) t.comment(await queueSummary(faults.pool));

  const requests = await requestsWithAttempts(faults.pool, ids);
  const problems = requests.flatMap((request) =>
    lifecycleProblems(request, MAX_ATTEMPTS).map((problem) => `${request.id}: ${problem}`),
  );
  t.same(problems.slice(0, 20), [], 'every request completed by the rules');
  t.same(tally(requests.map((request) => request.status)), `completed: ${ALL_REQUESTS}`, 'all completed');
  const deadWorker = running[0]!.worker_id;
  t.same(
    requests.filter((request) => {
      const [first, second] = request.attempt_rows;
      return !(first?.outcome === 'failed' && first.error_code === 'worker_lost' && first.worker_id === deadWorker && second?.outcome === 'succeeded');
    }).map((request) => request.id).slice(0, 20),
    [],
    'each: the attempt of the killed process recorded as worker_lost, then a second attempt that succeeded',
  );
  const recovery = requests.map((request) => (request.attempt_rows[1]?.started_at.getTime() ?? Infinity) - killedAt);
  t.same(recovery.filter((ms) => ms > ALL_RECOVERY_BOUND_MS), [], `each attempted again within ${ALL_RECOVERY_BOUND_MS / 1000} s of the kill`);
  t.comment(`next attempt after the kill (dead after ${DEAD_AFTER_MS} ms): ${spread(recovery)}`);

  await sleep(1_000);
  t.equal((await dispatchJobs(faults.db)).length, 0, 'no dispatch_queue job is left behind');

  await faults.finish(t);
});
