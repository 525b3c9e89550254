// A lane that time alone holds back (its requests_per_minute, a pause, a probe due) has its
// queue dispatched again, when the time comes, by the worker whose claim found it so; a retry,
// when it is due, by the worker that recorded it: not only by the dispatch job due then, which a
// worker fetches on its next poll for jobs. And a queue whose waiting requests ended before that
// time is dispatched for the next request accepted, not at the time set for the ones that ended.
import t from 'tap';
import { ensureLanes } from '../../src/lanes/repository.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { attemptRows, isTerminal, waitForRow } from '../helpers/rows.ts';
import { completionAfter, completionFor, startFakeUpstream } from '../helpers/upstream.ts';
import { upstreamsFile } from '../helpers/upstreams-file.ts';
import { until, waitFor } from '../helpers/wait.ts';

t.test('a burst on a lane paced by requests_per_minute completes as the limit allows, however seldom workers poll for jobs', async (t) => {
  const upstream = await startFakeUpstream(t);
  const file = await upstreamsFile(t, [
    { name: 'paced', base_url: upstream.baseUrl, models: ['gpt-paced'], limits: { requests_per_minute: 600 } },
  ]);
  // A poll for jobs every hour: each time the lane runs out of room, the dispatch job due when it
  // has room again would wait that long, so all 30 completed within the test is the worker's own
  // dispatch when the time comes.
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: file, WORKER_POLL_INTERVAL_MS: '3600000' } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const sentAt = Date.now();
  const answers = await Promise.all(
    Array.from({ length: 30 }, (_, i) => client.post({ model: 'gpt-paced', messages: userMessage(`paced ${i}`) })),
  );
  t.same(new Set(answers.map((answer) => answer.status)), new Set([202]), 'all 30 accepted');
  const ids = answers.map((answer) => answer.body.id as string);
  let lastFinishedAt = 0;
  await until(async () => {
    const { rows } = await gateway.pool.query<{ completed: number; last: Date | null }>(
      `select count(*) filter (where status = 'completed')::int as completed, max(finished_at) as last from gateway.requests where id = any($1::text[])`,
      [ids],
    );
    lastFinishedAt = rows[0]!.last?.getTime() ?? 0;
    return rows[0]!.completed === ids.length;
  }, 'all 30 completed', 25_000);
  // 10 calls a second, paced at 95 % with half a second's worth at once to start with: the last
  // of the 30 starts some 2.6 s after the first; waiting for polls, it would start after an hour.
  t.comment(`all completed ${lastFinishedAt - sentAt} ms after they were sent`);
  t.equal(upstream.calls.length, 30, 'one call each');
});

t.test('a retry is attempted when its backoff is over, however seldom workers poll for jobs', async (t) => {
  // The first call answers 500; the others complete.
  const upstream = await startFakeUpstream(t, (call) =>
    upstream.calls.length === 1 ? { status: 500 } : { status: 200, json: completionFor(call.body) },
  );
  const gateway = await startTestGateway(t, {
    // A poll for jobs every hour: the retry made within the test is the worker's own dispatch
    // when its backoff is over, not the dispatch job's, which would wait for that poll.
    env: { UPSTREAM_BASE_URL: upstream.baseUrl, WORKER_POLL_INTERVAL_MS: '3600000', RETRY_BASE_MS: '300', RETRY_MAX_MS: '300' },
  });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const accepted = await client.post({ model: 'gpt-retried', messages: userMessage('retried') });
  t.equal(accepted.status, 202);
  const row = await waitForRow(gateway.db, accepted.body.id as string, isTerminal, 40_000);
  t.equal(row.status, 'completed', 'completed');
  const [first, second] = await attemptRows(gateway.db, accepted.body.id as string);
  t.match([first, second], [{ outcome: 'failed', error_code: 'upstream_server_error' }, { outcome: 'succeeded' }], 'in a second attempt, after a 500');
  // A backoff of 300 ms at most (jittered), its dispatch at the end of its quarter second.
  t.comment(`attempted again ${second!.started_at.getTime() - first!.finished_at!.getTime()} ms after the first failed`);
});

for (const ending of ['cancelled', 'failed for its deadline'] as const) {
  t.test(`a request accepted after the one waiting was ${ending} starts at once, not when another deployment's pause ends`, async (t) => {
    // The first deployment takes one call at a time, each 3 s long.
    const first = await startFakeUpstream(t, completionAfter(3_000));
    const second = await startFakeUpstream(t);
    const file = await upstreamsFile(t, [
      { name: 'first', base_url: first.baseUrl, models: ['gpt-x'], limits: { max_concurrent: 1 } },
      { name: 'second', base_url: second.baseUrl, models: ['gpt-x'] },
    ]);
    // The API and the worker in processes of their own; the rescue of stranded queues looks every second.
    const env = { UPSTREAMS_FILE: file, UPSTREAM_TIMEOUT_MS: '10000', WORKER_DEAD_AFTER_MS: '2000' };
    const api = await startTestGateway(t, { role: 'api', env });
    await startTestGateway(t, { role: 'worker', env, databaseUrl: api.databaseUrl });
    const key = await api.createKey({ mode: 'live', project: 'p' });
    const client = clientFor(api.url, key);
    const ended = ending === 'cancelled' ? client : clientFor(api.url, await api.createKey({ mode: 'live', project: 'p', deadlineMs: 1_000 }));
    const made = await client.post({ model: 'gpt-x', messages: userMessage('lanes made') });
    await until(async () => (await client.get(made.body.id)).body.status === 'completed', 'a first request to make the lanes', 8_000);
    const { rows: queues } = await api.pool.query(`select id from gateway.queues where model = 'gpt-x'`);
    const queueId = queues[0].id;
    // The second deployment answered a 429 with retry-after: 3600 a moment ago.
    const [, secondLane] = await ensureLanes(api.db, { id: queueId, mode: 'live', model: 'gpt-x' }, ['first', 'second']);
    await api.pool.query(`update gateway.lanes set paused_until = now() + interval '1 hour' where id = $1`, [secondLane]);

    // A request waits for the first deployment's call, and the queue for the second's pause.
    const running = await client.post({ model: 'gpt-x', messages: userMessage('running') });
    await until(() => first.calls.length === 2, 'the first deployment\'s call to start');
    const waiting = await ended.post({ model: 'gpt-x', messages: userMessage('waiting') });
    const wakeAt = async () => (await api.pool.query(`select wake_at from gateway.queues where id = $1`, [queueId])).rows[0].wake_at as Date | null;
    await until(async () => ((await wakeAt())?.getTime() ?? 0) > Date.now() + 59 * 60_000, 'the queue to wait for the second\'s pause');
    if (ending === 'cancelled') {
      t.equal((await send(api.url, { method: 'POST', path: `/v1/requests/${waiting.body.id}/cancel`, key })).status, 200);
    }
    await until(async () => (await client.get(waiting.body.id)).body.status !== 'queued', `the waiting request to be ${ending}`, 3_000);
    await until(async () => (await client.get(running.body.id)).body.status === 'completed', 'the first deployment\'s call to end', 8_000);
    t.ok(await waitFor(async () => (await wakeAt()) === null, 3_000), 'the dispatch at the call\'s end found nothing due, and cleared queues.wake_at');

    const accepted = await client.post({ model: 'gpt-x', messages: userMessage('accepted') });
    t.equal(accepted.status, 202);
    await until(async () => (await client.get(accepted.body.id)).body.status === 'completed', 'the request accepted to complete', 8_000);
    t.equal(first.calls.length, 3, 'on the first deployment');
    t.equal(second.calls.length, 0);
  });
}
