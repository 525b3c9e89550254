import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { clientFor, userMessage } from '../helpers/http.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { attemptRows, dispatchJobs, requestRow, waitForRow } from '../helpers/rows.ts';
import { OWN_DISPATCH_FALLBACK_MS } from '../../src/worker/dispatcher.ts';

t.test('wait=false answers 202 with the acknowledgement, after the row and its lane\'s dispatch are committed', async (t) => {
  // API only: no worker, so the request stays exactly as it was accepted.
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const before = Math.floor(Date.now() / 1000);

  const answer = await clientFor(gateway.url, key).post({ model: 'test-echo', messages: userMessage(), wait: false });

  t.equal(answer.status, 202);
  t.same(Object.keys(answer.body).sort(), ['created', 'id', 'object', 'status']);
  t.match(answer.body.id, /^req_[A-Za-z0-9]{20,40}$/);
  t.equal(answer.body.object, 'chat.completion.async');
  t.equal(answer.body.status, 'queued');
  t.ok(answer.body.created >= before && answer.body.created <= Math.ceil(Date.now() / 1000));

  const row = await requestRow(gateway.db, answer.body.id);
  t.equal(row?.status, 'queued');
  t.equal(row?.attempts, 0);
  t.ok(row?.next_attempt_at && row.next_attempt_at <= new Date(), 'due at once');
  t.same((await dispatchJobs(gateway.db)).map((job) => job.queue_id), [row?.queue_id], 'and its queue woken by a dispatch job');
});

t.test('a process that also runs a worker dispatches what it accepts at once: its dispatch job is a fallback, due later', async (t) => {
  const gateway = await startTestGateway(t);
  const answer = await clientFor(gateway.url, await gateway.createKey()).post({ model: 'test-echo', messages: userMessage(), wait: true });
  t.equal(answer.status, 200, 'completed');
  const { rows } = await gateway.pool.query('select id from gateway.requests');
  const row = await requestRow(gateway.db, rows[0].id);
  const jobs = await dispatchJobs(gateway.db);
  t.same(jobs.map((job) => job.queue_id), [row?.queue_id], 'its queue has a dispatch job');
  t.equal(jobs[0]!.run_at.getTime() - row!.created_at.getTime(), OWN_DISPATCH_FALLBACK_MS, 'due OWN_DISPATCH_FALLBACK_MS after the request was accepted');
  t.ok(row!.finished_at! < jobs[0]!.run_at, 'and the request completed before it was due');
});

t.test('wait defaults to false', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const answer = await clientFor(gateway.url, await gateway.createKey()).post({ model: 'm', messages: userMessage() });
  t.equal(answer.status, 202);
  t.equal(answer.body.status, 'queued');
});

t.test('wait=true answers 200 with the completion when it finishes within the wait timeout', async (t) => {
  const gateway = await startTestGateway(t);
  const key = await gateway.createKey();
  const answer = await clientFor(gateway.url, key).post({
    model: 'test-delay-200',
    messages: userMessage('take 200 ms'),
    wait: true,
  });
  t.equal(answer.status, 200);
  t.equal(answer.body.object, 'chat.completion');
  t.match(answer.body.id, /^chatcmpl-/);
  t.equal(answer.body.choices[0].message.content, 'take 200 ms');

  // The body is the stored result, verbatim.
  const { rows } = await gateway.pool.query('select result::text as result from gateway.requests');
  t.equal(rows.length, 1);
  t.equal(answer.text, rows[0].result);
});

t.test('wait=true falls back to the 202 acknowledgement after WAIT_TIMEOUT_MS, then completes', async (t) => {
  const gateway = await startTestGateway(t, { env: { WAIT_TIMEOUT_MS: '300' } });
  const key = await gateway.createKey();
  const client = clientFor(gateway.url, key);
  const answer = await client.post({ model: 'test-delay-1000', messages: userMessage(), wait: true });

  t.equal(answer.status, 202);
  t.equal(answer.body.object, 'chat.completion.async');
  t.equal(answer.body.status, 'processing', 'carries the status at the time of the timeout');

  await waitForRow(gateway.db, answer.body.id, (row) => row.status === 'completed');
  const record = await client.get(answer.body.id);
  t.equal(record.status, 200);
  t.equal(record.body.status, 'completed');
  t.equal(record.body.result.object, 'chat.completion');
});

t.test('wait=true answers a request that failed before the timeout at once, with 202 and status failed', async (t) => {
  // The longest wait timeout there is, ten minutes, far past the test's own time: an answer at
  // all is the one given when the request failed, not the one at the timeout (which would say
  // failed too). The test waits 20 s for it, not the ten minutes, so that a waiter left to its
  // timeout fails here rather than holding the file until tap's timeout.
  const gateway = await startTestGateway(t, { env: { WAIT_TIMEOUT_MS: '600000' } });
  const key = await gateway.createKey();
  const answering = clientFor(gateway.url, key).post({ model: 'test-error-400', messages: userMessage(), wait: true });
  const answer = await Promise.race([answering, sleep(20_000).then(() => undefined)]);
  t.equal(answer?.status, 202, 'answered, without sitting out the wait timeout');
  if (answer === undefined) return;
  t.equal(answer.body.status, 'failed');
  const row = await requestRow(gateway.db, answer.body.id);
  t.equal(row?.last_error_code, 'upstream_bad_request');
  t.equal((await attemptRows(gateway.db, answer.body.id)).length, 1);
});
