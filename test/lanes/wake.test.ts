// A lane that time alone holds back (its requests_per_minute, a pause, a probe due) has its
// queue dispatched again, when the time comes, by the worker whose claim found it so; a retry,
// when it is due, by the worker that recorded it: not only by the dispatch job due then, which a
// worker fetches on its next poll for jobs.
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { attemptRows, isTerminal, waitForRow } from '../helpers/rows.ts';
import { completionFor, startFakeUpstream } from '../helpers/upstream.ts';
import { upstreamsFile } from '../helpers/upstreams-file.ts';
import { until } from '../helpers/wait.ts';

t.test('a burst on a lane paced by requests_per_minute takes about the time the limit allows, however seldom workers poll for jobs', async (t) => {
  const upstream = await startFakeUpstream(t);
  const file = await upstreamsFile(t, [
    { name: 'paced', base_url: upstream.baseUrl, models: ['gpt-paced'], limits: { requests_per_minute: 600 } },
  ]);
  // A poll for jobs every 30 s: each time the lane runs out of room, the dispatch job due when
  // it has room again would wait that long.
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: file, WORKER_POLL_INTERVAL_MS: '30000' } });
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
  // of the 30 starts some 2.6 s after the first; waiting for polls, it would start after 30 s or more.
  const tookMs = lastFinishedAt - sentAt;
  t.ok(tookMs < 8_000, `all completed ${tookMs} ms after they were sent`);
  t.equal(upstream.calls.length, 30, 'one call each');
});

t.test('a retry is attempted when its backoff is over, however seldom workers poll for jobs', async (t) => {
  // The first call answers 500; the others complete.
  const upstream = await startFakeUpstream(t, (call) =>
    upstream.calls.length === 1 ? { status: 500 } : { status: 200, json: completionFor(call.body) },
  );
  const gateway = await startTestGateway(t, {
    env: { UPSTREAM_BASE_URL: upstream.baseUrl, WORKER_POLL_INTERVAL_MS: '30000', RETRY_BASE_MS: '300', RETRY_MAX_MS: '300' },
  });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const accepted = await client.post({ model: 'gpt-retried', messages: userMessage('retried') });
  t.equal(accepted.status, 202);
  const row = await waitForRow(gateway.db, accepted.body.id as string, isTerminal, 40_000);
  t.equal(row.status, 'completed', 'completed');
  const [first, second] = await attemptRows(gateway.db, accepted.body.id as string);
  t.match([first, second], [{ outcome: 'failed', error_code: 'upstream_server_error' }, { outcome: 'succeeded' }], 'in a second attempt, after a 500');
  // A backoff of 300 ms at most (jittered), its dispatch at the end of its quarter second.
  const againAfterMs = second!.started_at.getTime() - first!.finished_at!.getTime();
  t.ok(againAfterMs < 3_000, `attempted again ${againAfterMs} ms after the first failed`);
});
