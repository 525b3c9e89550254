// Intake limits over HTTP: RATE_LIMIT_RPS with a burst of twice that,
// lookups with their own limit, MAX_UNFINISHED_PER_PROJECT, each a 429 rate_limit_exceeded with
// retry-after that stores nothing; and the rate holding across two API processes.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { freePort } from '../helpers/ports.ts';
import { countRows } from '../helpers/rows.ts';
import { serveSettings, spawnServe } from '../helpers/serve.ts';
import { until } from '../helpers/wait.ts';

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

t.test('with two API processes, the 429s come within 10 % of RATE_LIMIT_RPS', async (t) => {
  const setup = await startTestGateway(t, { role: 'api' });
  await setup.stop();
  const key = await setup.createKey({ mode: 'test' });
  const port = await freePort();
  const rate = 50;
  const serve = spawnServe(
    t,
    serveSettings(setup, port, {
      API_PROCESSES: '2',
      LOG_LEVEL: 'info',
      RATE_LIMIT_RPS: String(rate),
    }),
    ['--role', 'api'],
  );
  await until(() => serve.output().includes('API processes listening'), () => `the API processes:\n${serve.output()}`, 15_000);
  const client = clientFor(`http://127.0.0.1:${port}`, key);

  // 200 requests a second for 4 s, four times the rate.
  const seconds = 4;
  const offered = 200 * seconds;
  const started = performance.now();
  const answers = [];
  for (let i = 0; i < offered; i++) {
    const due = started + (i * 1000) / 200;
    const wait = due - performance.now();
    if (wait > 0) await sleep(wait);
    answers.push(client.post({ model: 'test-echo', messages: userMessage(`n${i}`) }));
  }
  const settled = await Promise.all(answers);
  const elapsed = (performance.now() - started) / 1000;
  const admitted = settled.filter((answer) => answer.status === 202).length;
  const refused = settled.filter((answer) => answer.status === 429).length;
  t.equal(admitted + refused, offered, 'every request admitted or refused with 429');
  const allowed = 2 * rate + rate * elapsed;
  t.ok(
    Math.abs(admitted - allowed) <= 0.1 * allowed,
    `${admitted} admitted over ${elapsed.toFixed(2)} s; the limit allows ${allowed.toFixed(0)} (within 10 %)`,
  );
  const servedBy = new Set(
    serve
      .output()
      .split('\n')
      .filter((line) => line.includes('"route":"/v1/chat/completions"') && line.includes('"status":202'))
      .map((line) => JSON.parse(line).pid as number),
  );
  t.equal(servedBy.size, 2, 'both API processes admitted some');
  t.equal(await countRows(setup.db, 'requests'), admitted, 'and stored only those');
});
