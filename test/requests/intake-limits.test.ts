// Intake limits over HTTP: RATE_LIMIT_RPS with a burst of twice that,
// lookups with their own limit, RATE_LIMIT_BYTES_PER_SECOND, MAX_UNFINISHED_PER_PROJECT, each a
// 429 rate_limit_exceeded with retry-after that stores nothing, and answered before the body of
// the submission it refuses is read. (The rate held across API processes: intake.test.ts.)
import http from 'node:http';
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import type { CreatedKey } from '../../src/keys/service.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { countRows } from '../helpers/rows.ts';

t.test('RATE_LIMIT_RPS: a burst of twice the rate, then 429 with retry-after; nothing stored for those', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { RATE_LIMIT_RPS: '2', LOOKUP_RATE_LIMIT_RPS: '100' } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'test' }));
  // Sent at once, so that the bucket refills little meanwhile however slow the machine is.
  const answers = await Promise.all(Array.from({ length: 6 }, () => client.post({ model: 'test-echo', messages: userMessage() })));
  t.same(answers.map((answer) => answer.status).sort(), [202, 202, 202, 202, 429, 429], 'four, then 429');
  const refused = answers.find((answer) => answer.status === 429)!;
  t.same(refused.body.error, { message: refused.body.error.message, type: 'rate_limit_error', code: 'rate_limit_exceeded', param: null });
  t.ok(Number(refused.headers.get('retry-after')) >= 1, `retry-after in whole seconds (${refused.headers.get('retry-after')})`);
  t.equal(await countRows(gateway.db, 'requests'), 4, 'the refused ones stored nothing');
  const { rows } = await gateway.pool.query('select count(*)::int as count from gateway.signature_nonces');
  t.equal(rows[0].count, 4, 'not even their nonces');

  const lookups = await Promise.all(answers.filter((answer) => answer.status === 202).map((answer) => client.get(answer.body.id)));
  t.same(lookups.map((answer) => answer.status), [200, 200, 200, 200], 'lookups have a limit of their own');

  await sleep(1_100);
  t.equal((await client.post({ model: 'test-echo', messages: userMessage() })).status, 202, 'accepted again after retry-after');
});

/**
 * Sends a submission's headers, announcing a body of `contentLength` bytes, and none of the body:
 * the answer the gateway gives without reading it, or undefined if it gives none within 5 s.
 */
async function answerBeforeBody(url: string, key: CreatedKey, contentLength: number) {
  const request = http.request(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${key.api_key}`, 'content-type': 'application/json', 'content-length': String(contentLength) },
  });
  request.on('error', () => {}); // destroyed below, body unsent
  request.flushHeaders();
  try {
    const response = await Promise.race([
      new Promise<http.IncomingMessage>((resolve) => request.once('response', resolve)),
      sleep(5_000).then(() => undefined),
    ]);
    if (!response) return undefined;
    let text = '';
    for await (const chunk of response) text += chunk;
    return { status: response.statusCode, retryAfter: response.headers['retry-after'], body: JSON.parse(text) };
  } finally {
    request.destroy();
  }
}

t.test('RATE_LIMIT_BYTES_PER_SECOND: a key over its byte rate is refused from Content-Length, before its body is sent; nothing stored', async (t) => {
  const gateway = await startTestGateway(t, {
    role: 'api',
    env: { RATE_LIMIT_BYTES_PER_SECOND: '100000', MAX_BODY_BYTES: '1048576' },
  });
  const key = await gateway.createKey({ mode: 'test' });
  const client = clientFor(gateway.url, key);
  const large = { model: 'test-echo', messages: userMessage('x'.repeat(900_000)) };
  t.equal((await client.post(large)).status, 202, 'one body of 900 kB fits the burst (at least MAX_BODY_BYTES)');

  const refused = await answerBeforeBody(gateway.url, key, 900_000);
  t.ok(refused, 'the next 900 kB are answered without being sent');
  t.equal(refused?.status, 429);
  t.match(refused?.body.error, { type: 'rate_limit_error', code: 'rate_limit_exceeded', message: /100000 body bytes per second/ });
  t.ok(Number(refused?.retryAfter) >= 7, `retry-after counts the bytes missing at 100,000 a second (${refused?.retryAfter} s)`);
  t.equal(
    (await client.post({ model: 'test-echo', messages: userMessage() })).status,
    202,
    'a small body still fits what is left',
  );
  t.equal(await countRows(gateway.db, 'requests'), 2, 'the refused one stored nothing');

  const other = clientFor(gateway.url, await gateway.createKey({ mode: 'test' }));
  t.equal((await other.post(large)).status, 202, 'another key has bytes of its own');
});

t.test('RATE_LIMIT_RPS refuses a submission before its body is read too', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { RATE_LIMIT_RPS: '1' } });
  const key = await gateway.createKey({ mode: 'test' });
  const client = clientFor(gateway.url, key);
  for (let i = 0; i < 2; i++) t.equal((await client.post({ model: 'test-echo', messages: userMessage() })).status, 202);
  const refused = await answerBeforeBody(gateway.url, key, 10_000);
  t.equal(refused?.status, 429, 'the third within the second is answered 429 with its body unsent');
  t.match(refused?.body.error, { code: 'rate_limit_exceeded', message: /1 requests per second/ });
});

t.test('a flood of invented model names refused by RATE_LIMIT_RPS creates no queue for them', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { RATE_LIMIT_RPS: '2' } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const answers = await Promise.all(Array.from({ length: 20 }, (_, i) => client.post({ model: `invented-${i}`, messages: userMessage() })));
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

t.test('MAX_UNFINISHED_PER_PROJECT counts requests stored as their own: not replays, nor requests refused after admission', async (t) => {
  // No worker: nothing finishes.
  const gateway = await startTestGateway(t, { role: 'api', env: { MAX_UNFINISHED_PER_PROJECT: '2' } });
  const client = clientFor(gateway.url, await gateway.createKey({ project: 'careful', mode: 'test' }));
  const first = await client.post({ model: 'test-echo', messages: userMessage(), idempotency_key: 'once' });
  t.equal(first.status, 202);
  // One after the other: each counts as unfinished from its admission until it is found a replay.
  for (let i = 0; i < 3; i++) {
    const replay = await client.post({ model: 'test-echo', messages: userMessage(), idempotency_key: 'once' });
    t.equal(replay.body.id, first.body.id, 'replayed');
  }
  const reused = await client.post({ model: 'test-echo', messages: userMessage('another prompt'), idempotency_key: 'once' });
  t.equal(reused.status, 422, 'a key reused for another body is refused after its admission');
  // The process counts the project's unfinished requests every 100 ms: wait for a count.
  await sleep(300);
  t.equal((await client.post({ model: 'test-echo', messages: userMessage() })).status, 202, 'the second request is admitted');
  let refused = await client.post({ model: 'test-echo', messages: userMessage() });
  for (let i = 0; i < 20 && refused.status === 202; i++) {
    await sleep(100);
    refused = await client.post({ model: 'test-echo', messages: userMessage() });
  }
  t.equal(refused.status, 429, 'then the limit');
  t.equal(await countRows(gateway.db, 'requests'), 2, 'two stored');
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

t.test('MAX_UNFINISHED_PER_PROJECT: a project this process has not counted yet waits for its count, and gets no more than its limit', async (t) => {
  // No worker: nothing finishes.
  const env = { MAX_UNFINISHED_PER_PROJECT: '3' };
  const a = await startTestGateway(t, { role: 'api', env });
  const b = await startTestGateway(t, { role: 'api', env, databaseUrl: a.databaseUrl });
  const key = await a.createKey({ project: 'full', mode: 'test' });
  const onA = clientFor(a.url, key);
  const onB = clientFor(b.url, key);
  const post = (client: typeof onA) => client.post({ model: 'test-echo', messages: userMessage() });
  const statuses = async (client: typeof onA) => (await Promise.all(Array.from({ length: 3 }, () => post(client)))).map((answer) => answer.status);

  t.same(await statuses(onA), [202, 202, 202], 'its limit, at once, on a process that had not seen it');
  t.same(await statuses(onB), [429, 429, 429], 'another process, not having seen it either, counts it before it admits');
  // A process forgets a project after 5 s without a submission from it.
  await sleep(5_500);
  t.same(await statuses(onA), [429, 429, 429], 'the first process, having forgotten it while it was quiet, counts it again');
  t.equal(await countRows(a.db, 'requests'), 3, 'three unfinished requests stored, no more');
});
