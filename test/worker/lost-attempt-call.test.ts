// A worker taken for dead (its heartbeat late) while its call of attempt 1 is still in flight has
// that attempt recorded as worker_lost by another worker's sweep, and the retry, due at once, may
// be claimed by this same process. Its calls of both attempts are then in flight together: when
// attempt 1's call lands, attempt 2's must still be abortable by a cancel (or its deadline), and
// stop() must still wait for it.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { LANE_HEALTH } from '../../src/lanes/health.ts';
import { finishAttempts } from '../../src/worker/attempts-repository.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { attemptRows, requestRow, waitForRow } from '../helpers/rows.ts';
import { completionFor, startFakeUpstream, type Reply } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';

t.test("after its attempt 1 was recorded as lost, a cancel still aborts the same process's call of attempt 2", async (t) => {
  const pending: ((reply: Reply) => void)[] = [];
  const upstream = await startFakeUpstream(t, () => new Promise<Reply>((resolve) => pending.push(resolve)));
  t.teardown(() => {
    for (const resolve of pending) resolve({ status: 500 });
  });
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl, UPSTREAM_TIMEOUT_MS: '60000' } });
  const key = await gateway.createKey({ mode: 'live' });
  const accepted = await clientFor(gateway.url, key).post({ model: 'gpt-x', messages: userMessage() });
  const id = accepted.body.id as string;
  await until(() => upstream.calls.length === 1, 'attempt 1 to reach the upstream');

  // What another worker's sweep does, having found this worker's heartbeat too old.
  const { finished } = await finishAttempts(
    gateway.db,
    [{ kind: 'retry', id, attempt: 1, delayMs: 0, unchargedDelayMs: 0, fault: 'worker', code: 'worker_lost', detail: 'lost', upstreamStatus: null, durationMs: null }],
    { maxAttempts: 5, health: LANE_HEALTH },
  );
  t.match(finished, [{ status: 'retrying' }]);
  await until(() => upstream.calls.length === 2, 'attempt 2 to reach the upstream', 10_000);
  t.match(await requestRow(gateway.db, id), { status: 'processing', attempts: 2 });

  // Attempt 1's answer lands, late: nobody records it.
  pending.shift()!({ status: 200, json: completionFor({ messages: [{ content: 'x' }] }) });
  await until(() => upstream.calls[0]!.endedAt !== undefined, 'attempt 1 to end');
  await sleep(300);

  const answer = await send(gateway.url, { method: 'POST', path: `/v1/requests/${id}/cancel`, key });
  t.match(answer.body, { status: 'cancelled', attempts: 2 });
  await waitForRow(gateway.db, id, (row) => row.status === 'cancelled');
  await until(() => upstream.calls[1]!.endedAt !== undefined, "the cancel to abort attempt 2's upstream call", 5_000);
  t.same(
    (await attemptRows(gateway.db, id)).map((row) => [row.attempt_number, row.outcome, row.error_code]),
    [[1, 'failed', 'worker_lost'], [2, 'cancelled', null]],
    'attempt 1 lost, attempt 2 cancelled',
  );
});
