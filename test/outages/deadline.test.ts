// Outage 6: REQUEST_DEADLINE of 8 s, the only upstream down (503) throughout. The requests'
// lane opens and they wait, uncharged, until their deadline passes: then each fails with
// deadline_exceeded within 5 s of its deadline_at, and its request.failed event is written and
// delivered to the project's webhook receiver.
import t from 'tap';
import { call, tally } from '../faults/support/client.ts';
import { waitUntilTerminal } from '../faults/support/rows.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { waitFor } from '../helpers/wait.ts';
import { addTestEndpoint, startReceiver } from '../webhooks/support.ts';
import { HEALTHS, lifecycleProblems, readsPath, MAX_ATTEMPTS, MODEL, outageReply, post, requestsWithAttempts, seconds, startOutageGateway, watchLane } from './support.ts';

const DEADLINE_MS = 8_000;
const FAIL_WITHIN_MS = 5_000;
const REQUESTS = 10;
const PROJECT = 'outages-deadline';

t.test('REQUEST_DEADLINE 8s, the upstream down throughout: each request fails with deadline_exceeded within 5 s of its deadline, and its request.failed event is delivered', async (t) => {
  const receiver = await startReceiver(t);
  const upstream = await startFakeUpstream(t, outageReply({ kind: 'status', status: 503 }));
  const gateway = await startOutageGateway(t, [{ name: 'primary', base_url: upstream.baseUrl, models: [MODEL] }], {
    REQUEST_DEADLINE: '8s',
    WEBHOOK_ALLOW_PRIVATE: 'true',
  });
  const key = await gateway.createKey({ project: PROJECT, mode: 'live' });
  const endpoint = await addTestEndpoint(gateway, { project: PROJECT, url: receiver.url });
  receiver.secrets = [endpoint.secret];
  const watch = watchLane(gateway.pool, 'primary', MODEL, 100);

  const accepted = await Promise.all(Array.from({ length: REQUESTS }, (_, i) => post(gateway.url, key, `deadline request ${i}`)));
  t.equal(tally(accepted.map((answer) => answer.status)), `202: ${REQUESTS}`, `all ${REQUESTS} acknowledged`);
  const ids = accepted.map((answer) => answer.body?.id as string);
  const ended = await waitUntilTerminal(gateway.pool, ids, DEADLINE_MS + FAIL_WITHIN_MS + 10_000);
  const reads = await watch.stop();
  t.ok(ended.done, `all ended (left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);

  const { rows } = await gateway.pool.query<{ id: string; created_at: Date; finished_at: Date | null; deadline_at: Date | null }>(
    `select id, created_at, finished_at, (to_jsonb(requests) ->> 'deadline_at')::timestamptz as deadline_at
     from gateway.requests where id = any($1::text[])`,
    [ids],
  );
  const requests = await requestsWithAttempts(gateway.pool, ids);
  t.equal(tally(requests.map((request) => `${request.status} ${request.last_error_code}`)), `failed deadline_exceeded: ${REQUESTS}`, 'each failed with deadline_exceeded');
  t.ok(rows.every((row) => row.deadline_at !== null), 'each has its deadline_at');
  const late = rows.map((row) => (row.finished_at?.getTime() ?? Infinity) - (row.deadline_at?.getTime() ?? row.created_at.getTime() + DEADLINE_MS));
  const deadlineGiven = rows.map((row) => (row.deadline_at?.getTime() ?? NaN) - row.created_at.getTime());
  t.same(deadlineGiven.filter((ms) => !(Math.abs(ms - DEADLINE_MS) <= 1_000)), [], `deadline_at is REQUEST_DEADLINE after acceptance (${deadlineGiven.join(', ')} ms)`);
  t.same(late.filter((ms) => !(ms >= 0 && ms <= FAIL_WITHIN_MS)), [], `each ended after its deadline_at and within ${seconds(FAIL_WITHIN_MS)} of it (${late.join(', ')} ms)`);
  const problems = requests.flatMap((request) => lifecycleProblems(request).map((problem) => `${request.id}: ${problem}`));
  t.same(problems, [], 'their rows keep the rules');
  t.ok(requests.every((request) => request.charged_attempts < MAX_ATTEMPTS), `none failed by running out of attempts (charged: ${tally(requests.map((request) => request.charged_attempts))})`);

  // Its lane was open (or probing) when the deadline passed.
  const firstDeadline = Math.min(...rows.map((row) => row.deadline_at?.getTime() ?? Infinity));
  const atDeadline = reads.filter((read) => read.at <= firstDeadline).at(-1);
  t.ok(atDeadline && atDeadline.health !== 'healthy', `the lane was not healthy when the deadlines passed (${atDeadline?.health}, last_error ${atDeadline?.last_error})`);

  t.same(
    [...new Set(reads.filter((read) => !HEALTHS.includes(read.health)).map((read) => read.health))],
    [],
    `lane_states showed only ${HEALTHS.join(', ')} for the lane, the file listing its upstream throughout`,
  );

  const record = await call(gateway.url, { path: `/v1/requests/${ids[0]}`, key });
  t.match(record.body, { status: 'failed', last_error_code: 'deadline_exceeded' }, 'a lookup answers it failed, deadline_exceeded');

  const { rows: messages } = await gateway.pool.query<{ request_id: string; event_type: string }>(
    `select request_id, event_type from gateway.webhook_messages where request_id = any($1::text[])`,
    [ids],
  );
  t.equal(tally(messages.map((message) => message.event_type)), `request.failed: ${REQUESTS}`, 'a request.failed message for each');
  t.same(new Set(messages.map((message) => message.request_id)), new Set(ids), 'one per request');
  const delivered = await waitFor(() => new Set(receiver.deliveries.filter((d) => d.verifiedWith.length > 0).map((d) => d.event?.data.id)).size >= REQUESTS, 15_000);
  t.ok(delivered, `each delivered to the receiver and verified (${receiver.deliveries.length} deliveries)`);
  t.same(
    receiver.deliveries.filter((d) => !(d.event?.type === 'request.failed' && d.event.data.status === 'failed' && d.event.data.last_error_code === 'deadline_exceeded')).map((d) => d.body.slice(0, 200)),
    [],
    'each a request.failed event of a failed request, deadline_exceeded',
  );

  const attempts = requests.flatMap((request) => request.attempt_rows);
  t.comment(`deadline_at − created_at: ${deadlineGiven.join(', ')} ms; finished_at − deadline_at: ${late.join(', ')} ms`);
  t.comment(`attempts: ${tally(attempts.map((attempt) => `${attempt.error_code} charged ${attempt.charged}`))}; upstream calls ${upstream.calls.length}; lane reads: ${readsPath(reads)}`);
});
