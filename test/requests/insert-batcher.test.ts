// Group commit: concurrent submissions share statements, and every one still gets its own,
// correct answer.
import type pg from 'pg';
import t from 'tap';
import { newRequestId } from '../../src/ids.ts';
import { InsertBatcher } from '../../src/requests/insert-batcher.ts';
import type { InsertResult } from '../../src/requests/insert-repository.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { send } from '../helpers/http.ts';
import { countRows, dispatchJobs, requestRow, waitForRow } from '../helpers/rows.ts';
import { signature } from '../helpers/signing.ts';
import { until } from '../helpers/wait.ts';

async function setup(t: Parameters<typeof startTestGateway>[0]) {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const { rows } = await gateway.pool.query('select project_id from gateway.api_keys where id = $1', [key.id]);
  const queue = await gateway.pool.query(`insert into gateway.queues (mode, model) values ('test', '*') returning id`);
  const request = (overrides: Record<string, unknown> = {}) => ({
    id: newRequestId(),
    project_id: rows[0].project_id as string,
    mode: 'test' as const,
    api_key_id: key.id,
    model: 'm',
    body: '{"model":"m","messages":[]}',
    body_sha256: Buffer.alloc(32, 1),
    idempotency_key: null,
    queue_id: queue.rows[0].id as string,
    prompt_tokens_estimate: null,
    deadline_ms: 86_400_000,
    ...overrides,
  });
  return { gateway, key, request, queueId: queue.rows[0].id as string };
}

t.test('concurrent inserts share statements; each gets its own row, and each statement wakes the queue', async (t) => {
  const { gateway, request, queueId } = await setup(t);
  const batcher = new InsertBatcher(gateway.db, { maxInFlight: 1 });
  const requests = Array.from({ length: 200 }, () => request());
  const results = await Promise.all(requests.map((r) => batcher.insert(r, undefined)));
  t.ok(results.every((result, i) => result.kind === 'inserted' && result.answer.id === requests[i]!.id));
  t.equal(batcher.stats.requests, 200);
  t.ok(batcher.stats.statements < 20, `200 inserts in ${batcher.stats.statements} statements`);
  t.equal(await countRows(gateway.db, 'requests'), 200);
  const jobs = await dispatchJobs(gateway.db);
  t.equal(jobs.length, batcher.stats.statements, 'one dispatch of the queue per statement');
  t.ok(jobs.every((job) => job.queue_id === queueId), 'of their queue');
  const waiting = await gateway.pool.query(`select count(*)::int as count from gateway.requests where status = 'queued' and next_attempt_at <= now()`);
  t.equal(waiting.rows[0].count, 200, 'every request queued and due');
});

t.test('with dispatchDelayMs, a queue has one dispatch job, due that much after its first request, and a worker runs the requests then', async (t) => {
  const { gateway, request } = await setup(t);
  const batcher = new InsertBatcher(gateway.db, { maxInFlight: 1, dispatchDelayMs: 1_000 });
  const [result] = await Promise.all([batcher.insert(request(), undefined), batcher.insert(request(), undefined)]);
  t.equal(result!.kind, 'inserted');
  for (let i = 0; i < 3; i++) await batcher.insert(request(), undefined);
  t.ok(batcher.stats.statements >= 4, `${batcher.stats.statements} statements`);
  const jobs = await dispatchJobs(gateway.db);
  t.equal(jobs.length, 1, 'one job for the queue, however many statements added it');
  const row = await requestRow(gateway.db, (result as { answer: { id: string } }).answer.id);
  t.equal(jobs[0]!.run_at.getTime() - row!.created_at.getTime(), 1_000, 'due a second after the first insert');
  await startTestGateway(t, { role: 'worker', databaseUrl: gateway.databaseUrl });
  const done = await waitForRow(gateway.db, row!.id, (current) => current.status === 'completed');
  t.ok(done.finished_at! >= jobs[0]!.run_at, 'completed once its job was due, with nothing else dispatching it');
  await until(async () => (await countRows(gateway.db, 'requests')) === 5 && (await unfinished(gateway.pool)) === 0, 'the queue\'s other requests to complete by the same job');
  t.pass('all five completed');
});

async function unfinished(pool: pg.Pool): Promise<number> {
  const { rows } = await pool.query(`select count(*)::int as count from gateway.requests where finished_at is null`);
  return rows[0].count;
}

t.test('a queue whose fallback is pending gets no other add_jobs call until that one is about to run', async (t) => {
  const { gateway, request } = await setup(t);
  const batcher = new InsertBatcher(gateway.db, { maxInFlight: 1, dispatchDelayMs: 60_000 });
  for (let i = 0; i < 5; i++) await batcher.insert(request(), undefined);
  t.equal(batcher.stats.statements, 5);
  const { rows } = await gateway.pool.query(
    `select key, revision from graphile_worker._private_jobs where key like 'dispatch_fallback:%'`,
  );
  t.equal(rows.length, 1, 'one fallback job');
  t.equal(rows[0].revision, 0, 'added by the first statement only: the others found it pending');
});

t.test('within one group: a repeated nonce is a replay, a repeated idempotency key one request', async (t) => {
  const { gateway, key, request } = await setup(t);
  const batcher = new InsertBatcher(gateway.db, { maxInFlight: 1 });
  const nonce = { api_key_id: key.id, nonce: 'same-nonce-0123456789' };
  const results = await Promise.all([
    batcher.insert(request(), nonce),
    batcher.insert(request(), nonce),
    batcher.insert(request({ idempotency_key: 'k' }), undefined),
    batcher.insert(request({ idempotency_key: 'k' }), undefined),
  ]);
  t.same(results.map((result) => result.kind), ['inserted', 'replayed_nonce', 'inserted', 'idempotency_key_taken']);
  t.equal(await countRows(gateway.db, 'requests'), 2);
});

t.test('one item the database refuses does not fail the others of its group', async (t) => {
  const { gateway, request } = await setup(t);
  const batcher = new InsertBatcher(gateway.db, { maxInFlight: 1 });
  const good = [request(), request(), request()];
  const settled = await Promise.allSettled([
    batcher.insert(good[0]!, undefined),
    batcher.insert(good[1]!, undefined),
    batcher.insert(request({ project_id: '999999' }), undefined), // no such project
    batcher.insert(good[2]!, undefined),
  ]);
  t.same(settled.map((outcome) => outcome.status), ['fulfilled', 'fulfilled', 'rejected', 'fulfilled']);
  t.equal(await countRows(gateway.db, 'requests'), 3);
});

t.test('the same signed request sent twice at once: one accepted, one refused as a replay', async (t) => {
  const { gateway, key } = await setup(t);
  const body = JSON.stringify({ model: 'm', messages: [{ role: 'user', content: 'twice' }] });
  const header = signature({ secret: key.signing_secret, method: 'POST', path: '/v1/chat/completions', body });
  const answers = await Promise.all(
    [1, 2].map(() =>
      send(gateway.url, { path: '/v1/chat/completions', body, key: key.api_key, headers: { 'svc-signature': header } }),
    ),
  );
  t.same(answers.map((answer) => answer.status).sort(), [202, 401]);
  t.equal(answers.find((answer) => answer.status === 401)!.body.error.code, 'replayed_request');
  t.equal(await countRows(gateway.db, 'requests'), 1);
});

t.test('50 inserts of 1 MiB bodies at once are written in several statements of 16 MiB at most', async (t) => {
  const { gateway, request } = await setup(t);
  const groups: number[] = [];
  const batcher = new InsertBatcher(gateway.db, { maxInFlight: 1, onGroup: (size) => groups.push(size) });
  const content = 'x'.repeat(1024 * 1024);
  const requests = Array.from({ length: 50 }, (_, i) => request({ body: JSON.stringify({ model: 'm', messages: [{ role: 'user', content: `${i}${content}` }] }) }));
  const results = await Promise.all(requests.map((r) => batcher.insert(r, undefined)));
  t.ok(results.every((result, i) => result.kind === 'inserted' && result.answer.id === requests[i]!.id), 'every one inserted');
  t.ok(groups.every((size) => size <= 15), `no statement holds more than 15 bodies of 1 MiB: ${groups.join(', ')}`);
  t.ok(groups.length >= 4, `${groups.length} statements`);
  const { rows } = await gateway.pool.query('select count(*)::int as count, min(octet_length(body::text))::int as bytes from gateway.requests');
  t.same(rows[0], { count: 50, bytes: Buffer.byteLength(requests[0]!.body) }, 'every body stored whole');
});

t.test('a small request is not held up behind large ones: bodies over 64 KiB are written apart, a statement at a time', async (t) => {
  const { gateway, request } = await setup(t);
  const batcher = new InsertBatcher(gateway.db, { maxInFlight: 2 });
  const content = 'x'.repeat(3 * 1024 * 1024);
  // 36 MiB of bodies: statements of 16 MiB at most, which one after another take a while.
  const large = Array.from({ length: 12 }, (_, i) => request({ body: JSON.stringify({ model: 'm', messages: [{ role: 'user', content: `${i}${content}` }] }) }));
  const order: string[] = [];
  const stored = (what: string) => (result: InsertResult) => {
    order.push(what);
    return result;
  };
  const results = await Promise.all([
    ...large.map((r) => batcher.insert(r, undefined).then(stored('large'))),
    batcher.insert(request(), undefined).then(stored('small')),
  ]);
  t.ok(results.every((result) => result.kind === 'inserted'), 'every one inserted');
  // Queued behind them, it would be stored last; apart, beside the first large one at most.
  t.ok(order.indexOf('small') <= 1, `the small one, sent last, was stored first or second (order: ${order.join(', ')})`);
  t.equal(await countRows(gateway.db, 'requests'), 13);
});
