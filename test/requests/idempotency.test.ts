// Idempotency keys (docs/api.md, "Idempotency"): the same key and body is the same request, a
// different body is a 422 that stores nothing, and concurrent first uses make one request.
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { countRows, dispatchJobs, waitForRow } from '../helpers/rows.ts';
import { newNonce, signature } from '../helpers/signing.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { upstreamsFile } from '../helpers/upstreams-file.ts';

t.test('the same key with the same body is the same request, whatever the key order and wait', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  const first = await client.post({ model: 'm', messages: userMessage(), idempotency_key: 'order-1' });
  t.equal(first.status, 202);
  t.equal(first.headers.get('idempotent-replayed'), null, 'a first use is not a replay');

  const again = await client.post({ idempotency_key: 'order-1', messages: userMessage(), model: 'm', wait: false });
  t.equal(again.status, 202);
  t.equal(again.body.id, first.body.id);
  t.equal(again.body.status, 'queued');
  t.equal(again.body.created, first.body.created);
  t.equal(again.headers.get('idempotent-replayed'), 'true');

  t.equal(await countRows(gateway.db, 'requests'), 1, 'one request');
  t.equal((await dispatchJobs(gateway.db)).length, 1, 'one dispatch of its lane: the replay added none');
});

t.test('a replay after completion answers at once, without a second upstream call', async (t) => {
  const upstream = await startFakeUpstream(t);
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const body = { model: 'gpt-test', messages: userMessage(), idempotency_key: 'once' };

  const first = await client.post({ ...body, wait: true });
  t.equal(first.status, 200);

  const replayWait = await client.post({ ...body, wait: true });
  t.equal(replayWait.status, 200, 'wait=true replay of a completed request: 200 at once');
  t.equal(replayWait.text, first.text, 'with the same completion');
  t.equal(replayWait.headers.get('idempotent-replayed'), 'true');

  const replayAsync = await client.post(body);
  t.equal(replayAsync.status, 202);
  t.equal(replayAsync.body.status, 'completed', 'the acknowledgement carries the current status');

  t.equal(upstream.calls.length, 1, 'the upstream was called once');
  t.equal(await countRows(gateway.db, 'requests'), 1);
});

t.test('a wait=true replay of a request still running waits for it', async (t) => {
  const gateway = await startTestGateway(t);
  const client = clientFor(gateway.url, await gateway.createKey());
  const body = { model: 'test-delay-400', messages: userMessage(), idempotency_key: 'slow' };
  const first = await client.post(body);
  const replay = await client.post({ ...body, wait: true });
  t.equal(replay.status, 200);
  t.equal(replay.body.object, 'chat.completion');
  t.equal(replay.headers.get('idempotent-replayed'), 'true');
  const row = await waitForRow(gateway.db, first.body.id, (row) => row.status === 'completed');
  t.equal(row.attempts, 1);
});

t.test('a replay is answered with its request even once its model is no longer served; a new request for it is refused', async (t) => {
  const upstream = await startFakeUpstream(t);
  const serving = (models: string[]) => upstreamsFile(t, [{ name: 'one', base_url: upstream.baseUrl, models }]);
  const before = await startTestGateway(t, { env: { UPSTREAMS_FILE: await serving(['gpt-old', 'gpt-kept']) } });
  const key = await before.createKey({ mode: 'live' });
  const body = { model: 'gpt-old', messages: userMessage(), idempotency_key: 'before' };
  const first = await clientFor(before.url, key).post({ ...body, wait: true });
  t.equal(first.status, 200);
  await before.stop();

  // The upstreams file changed: the gateway no longer serves gpt-old.
  const after = await startTestGateway(t, { role: 'api', databaseUrl: before.databaseUrl, env: { UPSTREAMS_FILE: await serving(['gpt-kept']) } });
  const client = clientFor(after.url, key);
  const stored = async () => {
    const { rows } = await after.pool.query(`
      select (select count(*)::int from gateway.requests) as requests,
             (select count(*)::int from gateway.signature_nonces) as nonces
    `);
    return rows[0];
  };

  const replayWait = await client.post({ ...body, wait: true });
  t.equal(replayWait.status, 200, 'wait=true replay of a completed request: 200 at once');
  t.equal(replayWait.text, first.text, 'with its completion');
  t.equal(replayWait.headers.get('idempotent-replayed'), 'true');
  const replayAsync = await client.post(body);
  t.equal(replayAsync.status, 202);
  t.equal(replayAsync.body.status, 'completed', 'the acknowledgement carries its current status');
  t.equal(replayAsync.headers.get('idempotent-replayed'), 'true');
  t.same(await stored(), { requests: 1, nonces: 3 }, 'no second request; each replay used its nonce up');

  for (const refused of [
    { ...body, idempotency_key: 'new' },
    { model: 'gpt-old', messages: userMessage() },
    { ...body, messages: userMessage('another body') },
  ]) {
    const answer = await client.post(refused);
    t.equal(answer.status, 400, 'a request that is not a replay is refused for its model');
    t.same(answer.body.error, { message: answer.body.error.message, type: 'invalid_request_error', code: 'invalid_parameter', param: 'model' });
    t.equal(answer.headers.get('idempotent-replayed'), null);
  }
  t.same(await stored(), { requests: 1, nonces: 3 }, 'the refusals stored nothing, not even their nonces');
  t.equal(upstream.calls.length, 1, 'the upstream was called once');
});

t.test('the same key with a different body is 422 and stores nothing', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  await client.post({ model: 'm', messages: userMessage('one'), idempotency_key: 'k1' });
  for (const changed of [
    { model: 'm', messages: userMessage('two'), idempotency_key: 'k1' },
    { model: 'other', messages: userMessage('one'), idempotency_key: 'k1' },
    { model: 'm', messages: userMessage('one'), idempotency_key: 'k1', temperature: 1 },
  ]) {
    const answer = await client.post(changed);
    t.equal(answer.status, 422);
    t.same(answer.body.error, {
      message: answer.body.error.message,
      type: 'idempotency_error',
      code: 'idempotency_key_reused',
      param: 'idempotency_key',
    });
  }
  t.equal(await countRows(gateway.db, 'requests'), 1);
});

t.test('a refused request naming a model without a queue leaves no queue, nor a place under MAX_PATTERN_MODELS taken', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { MAX_PATTERN_MODELS: '2' } });
  const key = await gateway.createKey({ mode: 'live' });
  const client = clientFor(gateway.url, key);
  const stored = async () => {
    const { rows } = await gateway.pool.query(`
      select (select count(*)::int from gateway.requests) as requests,
             (select count(*)::int from gateway.signature_nonces) as nonces,
             (select array_agg(model order by model) from gateway.queues) as queues
    `);
    return rows[0];
  };
  t.equal((await client.post({ model: 'gpt-a', messages: userMessage(), idempotency_key: 'k' })).status, 202);

  const reused = await client.post({ model: 'gpt-unused', messages: userMessage(), idempotency_key: 'k' });
  t.equal(reused.status, 422, 'the key reused with another model');
  t.same(await stored(), { requests: 1, nonces: 1, queues: ['gpt-a'] }, 'no queue, nor nonce, for it');

  const path = '/v1/chat/completions';
  const nonce = newNonce();
  const signed = (body: string) => ({ path, body, key, headers: { 'svc-signature': signature({ secret: key.signing_secret, method: 'POST', path, body, nonce }) } });
  t.equal((await send(gateway.url, signed(JSON.stringify({ model: 'gpt-a', messages: userMessage('two') })))).status, 202);
  const replayed = await send(gateway.url, signed(JSON.stringify({ model: 'gpt-other', messages: userMessage() })));
  t.equal(replayed.status, 401);
  t.equal(replayed.body.error.code, 'replayed_request', 'its nonce used before, with another model');
  t.same(await stored(), { requests: 2, nonces: 2, queues: ['gpt-a'] }, 'no queue for it');

  t.equal((await client.post({ model: 'gpt-b', messages: userMessage() })).status, 202, 'a second model has its place');
  const burst = await Promise.all(Array.from({ length: 50 }, () => client.post({ model: 'gpt-c', messages: userMessage() })));
  t.same(new Set(burst.map((answer) => answer.status)), new Set([400]), 'a third is beyond the bound');
  const again = await Promise.all(Array.from({ length: 50 }, () => client.post({ model: 'gpt-b', messages: userMessage() })));
  t.same(new Set(again.map((answer) => answer.status)), new Set([202]));
  t.same(await stored(), { requests: 53, nonces: 53, queues: ['gpt-a', 'gpt-b'] });
});

t.test('concurrent first uses of a model make one queue, and each its request in it', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const answers = await Promise.all(Array.from({ length: 100 }, (_, i) => client.post({ model: `gpt-${i % 2}`, messages: userMessage() })));
  t.same(new Set(answers.map((answer) => answer.status)), new Set([202]));
  const { rows } = await gateway.pool.query(
    'select queues.model, count(*)::int as requests from gateway.requests join gateway.queues on queues.id = requests.queue_id group by 1 order by 1',
  );
  t.same(rows, [{ model: 'gpt-0', requests: 50 }, { model: 'gpt-1', requests: 50 }]);
  t.equal((await gateway.pool.query('select count(*)::int as n from gateway.queues')).rows[0].n, 2, 'two queues');
});

t.test('concurrent first uses of one key create exactly one request, and all callers get its id', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  const answers = await Promise.all(
    Array.from({ length: 30 }, () => client.post({ model: 'm', messages: userMessage(), idempotency_key: 'race' })),
  );
  t.same(new Set(answers.map((answer) => answer.status)), new Set([202]));
  const ids = new Set(answers.map((answer) => answer.body.id));
  t.equal(ids.size, 1, 'one id for all');
  t.equal(answers.filter((answer) => answer.headers.get('idempotent-replayed') === null).length, 1, 'one creator');
  t.equal(await countRows(gateway.db, 'requests'), 1);
  t.equal((await dispatchJobs(gateway.db)).length, 1, 'and its lane woken once: the replays added no dispatch');
});

t.test('keys are scoped to a project and a mode', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const body = { model: 'm', messages: userMessage(), idempotency_key: 'shared' };
  const ids = new Set<string>();
  for (const key of [
    await gateway.createKey({ project: 'alpha', mode: 'test' }),
    await gateway.createKey({ project: 'alpha', mode: 'live' }),
    await gateway.createKey({ project: 'beta', mode: 'test' }),
  ]) {
    const answer = await clientFor(gateway.url, key).post(body);
    t.equal(answer.status, 202);
    t.equal(answer.headers.get('idempotent-replayed'), null);
    ids.add(answer.body.id);
  }
  t.equal(ids.size, 3);
  const sameScope = await clientFor(gateway.url, await gateway.createKey({ project: 'alpha', mode: 'test' })).post(body);
  t.ok(ids.has(sameScope.body.id), 'another key of the same project and mode replays');
  t.equal(sameScope.headers.get('idempotent-replayed'), 'true');
});
