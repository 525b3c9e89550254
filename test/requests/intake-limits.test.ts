// Intake limits over HTTP: RATE_LIMIT_RPS with a burst of twice that,
// lookups with their own limit, MAX_UNFINISHED_PER_PROJECT, each a 429 rate_limit_exceeded with
// retry-after that stores nothing. (The rate held across API processes: intake.test.ts.)
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { countRows } from '../helpers/rows.ts';

t.test('RATE_LIMIT_RPS: a burst of twice the rate, then 429 with retry-after; nothing stored for those', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { RATE_LIMIT_RPS: '2', LOOKUP_RATE_LIMIT_RPS: '100' } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'test' }));
  const answers = [];
  for (let i = 0; i < 6; i++) answers.push(await client.post({ model: 'test-echo', messages: userMessage() }));
  t.same(answers.map((answer) => answer.status), [202, 202, 202, 202, 429, 429], 'four, then 429');
  const refused = answers[4]!;
  t.same(refused.body.error, { message: refused.body.error.message, type: 'rate_limit_error', code: 'rate_limit_exceeded', param: null });
  t.ok(Number(refused.headers.get('retry-after')) >= 1, `retry-after in whole seconds (${refused.headers.get('retry-after')})`);
  t.equal(await countRows(gateway.db, 'requests'), 4, 'the refused ones stored nothing');
  const { rows } = await gateway.pool.query('select count(*)::int as count from gateway.signature_nonces');
  t.equal(rows[0].count, 4, 'not even their nonces');

  const lookups = await Promise.all(answers.slice(0, 4).map((answer) => client.get(answer.body.id)));
  t.same(lookups.map((answer) => answer.status), [200, 200, 200, 200], 'lookups have a limit of their own');

  await sleep(1_100);
  t.equal((await client.post({ model: 'test-echo', messages: userMessage() })).status, 202, 'accepted again after retry-after');
});

t.test('a flood of invented model names refused by RATE_LIMIT_RPS creates no queue for them', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { RATE_LIMIT_RPS: '2' } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const answers = [];
  for (let i = 0; i < 20; i++) answers.push(await client.post({ model: `invented-${i}`, messages: userMessage() }));
  const accepted = answers.filter((answer) => answer.status === 202).length;
  t.ok(accepted >= 4 && accepted <= 5, `${accepted} accepted, the rest refused with 429`);
  const { rows } = await gateway.pool.query('select count(*)::int as count from gateway.queues');
  t.equal(rows[0].count, accepted, 'one queue per accepted model, none for the refused');
});

t.test('LOOKUP_RATE_LIMIT_RPS refuses lookups beyond it, with the same 429', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { RATE_LIMIT_RPS: '100', LOOKUP_RATE_LIMIT_RPS: '1' } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'test' }));
  const id = (await client.post({ model: 'test-echo', messages: userMessage() })).body.id;
  const statuses = [];
  for (let i = 0; i < 4; i++) statuses.push((await client.get(id)).status);
  t.same(statuses, [200, 200, 429, 429]);
});

t.test('MAX_UNFINISHED_PER_PROJECT: beyond it a 429, for that project and mode only', async (t) => {
  // No worker: nothing finishes.
  const gateway = await startTestGateway(t, { role: 'api', env: { MAX_UNFINISHED_PER_PROJECT: '3' } });
  const full = clientFor(gateway.url, await gateway.createKey({ project: 'full', mode: 'test' }));
  const other = clientFor(gateway.url, await gateway.createKey({ project: 'other', mode: 'test' }));
  const fullLive = clientFor(gateway.url, await gateway.createKey({ project: 'full', mode: 'live' }));
  for (let i = 0; i < 3; i++) t.equal((await full.post({ model: 'test-echo', messages: userMessage() })).status, 202);
  // The process counts the project's unfinished requests in the database every 100 ms.
  let refused = await full.post({ model: 'test-echo', messages: userMessage() });
  for (let i = 0; i < 20 && refused.status === 202; i++) {
    await sleep(100);
    refused = await full.post({ model: 'test-echo', messages: userMessage() });
  }
  t.equal(refused.status, 429, 'the project is refused once its unfinished requests are counted');
  t.match(refused.body.error, { type: 'rate_limit_error', code: 'rate_limit_exceeded', message: /MAX_UNFINISHED_PER_PROJECT/ });
  const stored = await countRows(gateway.db, 'requests');
  t.ok(stored <= 4, `at most one admitted before the count came (${stored} stored)`);
  t.equal((await other.post({ model: 'test-echo', messages: userMessage() })).status, 202, 'another project is not');
  t.equal((await fullLive.post({ model: 'gpt-x', messages: userMessage() })).status, 202, 'nor the same project\'s other mode');

  await gateway.pool.query(
    `update gateway.requests set status = 'completed', result = '{}', finished_at = now()
     where mode = 'test' and project_id = (select id from gateway.projects where name = 'full')`,
  );
  // Once the next count has seen them finish.
  let admitted = await full.post({ model: 'test-echo', messages: userMessage() });
  for (let i = 0; i < 20 && admitted.status === 429; i++) {
    await sleep(100);
    admitted = await full.post({ model: 'test-echo', messages: userMessage() });
  }
  t.equal(admitted.status, 202, 'admitted again once they finished');
});
