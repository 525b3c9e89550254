// Local attempts (src/worker/local-attempts.ts): a process running both the API and a worker
// runs wait=true requests itself, their first attempt started as they are stored, under a
// lease job that recovers them if the process goes away.
import { createHash } from 'node:crypto';
import t, { type Test } from 'tap';
import { newRequestId } from '../../src/ids.ts';
import * as repository from '../../src/requests/repository.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { attemptRows, isTerminal, jobsFor, requestRow, waitForNoJobs, waitForRow } from '../helpers/rows.ts';
import { until } from '../helpers/wait.ts';

const LOCAL = /^local-/;

t.test('a wait=true request runs in the process that accepted it, and its lease job goes with its outcome', async (t) => {
  const gateway = await startTestGateway(t);
  const client = clientFor(gateway.url, await gateway.createKey());
  const answer = await client.post({ model: 'test-echo', messages: userMessage('local'), wait: true });
  t.equal(answer.status, 200);
  t.equal(answer.body.object, 'chat.completion');
  t.equal(answer.body.choices[0].message.content, 'local');

  const { rows } = await gateway.pool.query<{ id: string }>('select id from gateway.requests');
  t.equal(rows.length, 1);
  const id = rows[0]!.id;
  t.match(await requestRow(gateway.db, id), { status: 'completed', attempts: 1, last_error_code: null });
  const attempts = await attemptRows(gateway.db, id);
  t.equal(attempts.length, 1);
  t.match(attempts[0], { attempt_number: 1, outcome: 'succeeded', worker_id: LOCAL });
  // Removed in the statement that recorded the outcome, not later in a batch.
  t.same(await jobsFor(gateway.db, id), [], 'no job left');
});

t.test('a wait=false request is acknowledged queued, then claimed and run by the process that accepted it', async (t) => {
  const gateway = await startTestGateway(t);
  const client = clientFor(gateway.url, await gateway.createKey());
  const answer = await client.post({ model: 'test-echo', messages: userMessage(), wait: false });
  t.equal(answer.status, 202);
  t.equal(answer.body.status, 'queued', 'as the contract says: its attempt had not started at the commit');
  const id = answer.body.id;
  t.match(await waitForRow(gateway.db, id, isTerminal), { status: 'completed', attempts: 1 });
  t.match(await attemptRows(gateway.db, id), [{ attempt_number: 1, outcome: 'succeeded', worker_id: LOCAL }]);
  t.same(await jobsFor(gateway.db, id), [], 'its lease job removed with the outcome');
});

t.test('with LOCAL_ATTEMPTS=0, and in an API process without a worker, every request takes the queue', async (t) => {
  for (const wait of [false, true]) {
    const gateway = await startTestGateway(t, { env: { LOCAL_ATTEMPTS: '0' } });
    const client = clientFor(gateway.url, await gateway.createKey());
    const answer = await client.post({ model: 'test-echo', messages: userMessage(), wait });
    const id = answer.status === 202 ? answer.body.id : (await gateway.pool.query('select id from gateway.requests')).rows[0].id;
    await waitForRow(gateway.db, id, isTerminal);
    const [attempt] = await attemptRows(gateway.db, id);
    t.notMatch(attempt!.worker_id, LOCAL, `wait=${wait}: run by the queue's worker`);
  }
  const api = await startTestGateway(t, { role: 'api' });
  const answer = await clientFor(api.url, await api.createKey()).post({ model: 'test-echo', messages: userMessage() });
  t.match(await jobsFor(api.db, answer.body.id), [{ attempt: 1 }], 'role api: a job due now');
  t.ok((await jobsFor(api.db, answer.body.id))[0]!.run_at <= new Date(), 'not a lease');
});

t.test('a local attempt that fails is retried through the queue', async (t) => {
  const gateway = await startTestGateway(t);
  const client = clientFor(gateway.url, await gateway.createKey());
  const answer = await client.post({ model: 'test-fail-1', messages: userMessage(), wait: true });
  t.equal(answer.status, 200, 'the wait still ends with the completion');
  const id = (await gateway.pool.query('select id from gateway.requests')).rows[0].id;
  t.match(await requestRow(gateway.db, id), { status: 'completed', attempts: 2, last_error_code: 'upstream_server_error' });
  const attempts = await attemptRows(gateway.db, id);
  t.match(attempts, [
    { attempt_number: 1, outcome: 'failed', error_code: 'upstream_server_error', worker_id: LOCAL },
    { attempt_number: 2, outcome: 'succeeded' },
  ]);
  t.notMatch(attempts[1]!.worker_id, LOCAL, 'the retry ran from its job');
  await waitForNoJobs(gateway.db, id);
});

t.test('beyond LOCAL_ATTEMPTS at once, wait=true requests take the queue', async (t) => {
  const gateway = await startTestGateway(t, { env: { LOCAL_ATTEMPTS: '1' } });
  const client = clientFor(gateway.url, await gateway.createKey());
  const answers = await Promise.all(
    [1, 2, 3].map((n) => client.post({ model: 'test-delay-500', messages: userMessage(`${n}`), wait: true })),
  );
  t.same(answers.map((answer) => answer.status), [200, 200, 200]);
  const { rows } = await gateway.pool.query<{ worker_id: string }>('select worker_id from gateway.request_attempts');
  t.equal(rows.length, 3);
  t.equal(rows.filter((row) => LOCAL.test(row.worker_id)).length, 1, 'one ran locally, two from the queue');
});

t.test('a local attempt that outlasts WORKER_DEAD_AFTER_MS keeps its lease', async (t) => {
  const gateway = await startTestGateway(t, { env: { WORKER_DEAD_AFTER_MS: '500', UPSTREAM_TIMEOUT_MS: '5000' } });
  const client = clientFor(gateway.url, await gateway.createKey());
  const answer = await client.post({ model: 'test-delay-2000', messages: userMessage(), wait: true });
  t.equal(answer.status, 200);
  const id = (await gateway.pool.query('select id from gateway.requests')).rows[0].id;
  t.match(await requestRow(gateway.db, id), { status: 'completed', attempts: 1, last_error_code: null });
  t.match(await attemptRows(gateway.db, id), [{ attempt_number: 1, outcome: 'succeeded', worker_id: LOCAL }]);
  t.same(await jobsFor(gateway.db, id), []);
});

/**
 * What a process that accepted a request leaves behind when it dies right after the commit,
 * stored as insertRequests stores it with a lease of 300 ms (started: its attempt 1 under way),
 * in the database of an API process without a worker. Nothing will ever run it locally.
 */
async function storeAbandoned(t: Test, started: boolean) {
  const api = await startTestGateway(t, { role: 'api' });
  const key = await api.createKey();
  const { rows } = await api.pool.query<{ project_id: string }>('select project_id from gateway.api_keys where id = $1', [key.id]);
  const body = JSON.stringify({ model: 'test-echo', messages: userMessage('abandoned') });
  const id = newRequestId();
  const [inserted] = await repository.insertRequests(api.db, [{
    request: {
      id,
      project_id: rows[0]!.project_id,
      mode: 'test',
      api_key_id: key.id,
      model: 'test-echo',
      body,
      body_sha256: createHash('sha256').update(body).digest(),
      idempotency_key: null,
    },
    nonce: undefined,
    lease: { workerId: 'local-gone', leaseMs: 300, started },
  }]);
  return { api, id, inserted };
}

t.test('when the process that stored a local attempt is gone, its lease job recovers it', async (t) => {
  const { api, id, inserted } = await storeAbandoned(t, true);
  t.match(inserted, { kind: 'inserted', answer: { id, status: 'processing' }, leaseJobId: /^\d+$/ });
  t.match(await requestRow(api.db, id), { status: 'processing', attempts: 1 });
  t.match(await jobsFor(api.db, id), [{ attempt: 1 }], 'its job is the lease');

  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl });
  const row = await waitForRow(api.db, id, isTerminal);
  t.match(row, { status: 'completed', attempts: 2, last_error_code: 'worker_lost' });
  t.match(await attemptRows(api.db, id), [
    { attempt_number: 1, outcome: 'failed', error_code: 'worker_lost', worker_id: 'local-gone' },
    { attempt_number: 2, outcome: 'succeeded' },
  ]);
  await waitForNoJobs(api.db, id);
});

t.test('a queued request whose accepting process is gone before claiming it runs from its lease job', async (t) => {
  const { api, id, inserted } = await storeAbandoned(t, false);
  t.match(inserted, { kind: 'inserted', answer: { id, status: 'queued' }, leaseJobId: /^\d+$/ });
  t.same(await attemptRows(api.db, id), [], 'no attempt started');

  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl });
  t.match(await waitForRow(api.db, id, isTerminal), { status: 'completed', attempts: 1, last_error_code: null });
  const [attempt] = await attemptRows(api.db, id);
  t.notMatch(attempt!.worker_id, LOCAL, 'run by the worker that took the lease job');
  await waitForNoJobs(api.db, id);
});

t.test('shutdown: a local attempt gets SHUTDOWN_GRACE_MS, then is handed to the queue as worker_lost', async (t) => {
  const gateway = await startTestGateway(t, { env: { SHUTDOWN_GRACE_MS: '200', WAIT_TIMEOUT_MS: '10000' } });
  const client = clientFor(gateway.url, await gateway.createKey());
  const waiting = client.post({ model: 'test-delay-1500', messages: userMessage(), wait: true });
  let stored: string | undefined;
  await until(async () => !!(stored = (await gateway.pool.query('select id from gateway.requests')).rows[0]?.id), 'the request to be stored');
  const id = stored!;
  await gateway.stop();
  const answer = await waiting;
  t.equal(answer.status, 202, 'the waiting client got its acknowledgement');
  t.equal(answer.body.id, id);
  t.match(await requestRow(gateway.db, id), { status: 'retrying', attempts: 1, last_error_code: 'worker_lost' });
  t.match(await jobsFor(gateway.db, id), [{ attempt: 2 }], 'the lease job gone, the retry\'s job waiting');

  await startTestGateway(t, { role: 'worker', databaseUrl: gateway.databaseUrl });
  t.match(await waitForRow(gateway.db, id, isTerminal), { status: 'completed', attempts: 2 });
});
