// The psql views (request_counts, waiting_requests, recent_errors, attempt_history) answer
// correctly against a populated database, and every query of docs/operations.md's "Inspecting with psql" section runs as written.
import { readFile } from 'node:fs/promises';
import t from 'tap';
import { newRequestId, requestIdFloor } from '../src/ids.ts';
import { startTestGateway } from './helpers/gateway.ts';
import { plantRequest } from './helpers/populate.ts';

const MINUTE = 60_000;

t.test('the views', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const alpha = await gateway.createKey({ project: 'alpha', mode: 'test' });
  const beta = await gateway.createKey({ project: 'beta', mode: 'live' });
  const completed = await plantRequest(gateway, alpha, {
    status: 'completed',
    ageMs: 10 * MINUTE,
    attempts: [{ outcome: 'failed', code: 'upstream_server_error', finishedAgoMs: 9 * MINUTE }, { outcome: 'succeeded' }],
  });
  await plantRequest(gateway, alpha, { status: 'completed', ageMs: 5 * MINUTE, attempts: [{ outcome: 'succeeded' }] });
  await plantRequest(gateway, alpha, {
    status: 'failed',
    ageMs: 3 * MINUTE,
    attempts: [{ outcome: 'failed', code: 'upstream_bad_request', finishedAgoMs: 2 * MINUTE }],
  });
  await plantRequest(gateway, alpha, {
    status: 'failed',
    ageMs: 3 * 60 * MINUTE,
    attempts: [{ outcome: 'failed', code: 'upstream_bad_request', finishedAgoMs: 2 * 60 * MINUTE }],
  });
  const oldestWaiting = await plantRequest(gateway, beta, { status: 'queued', ageMs: 20 * MINUTE, mode: 'live' });
  const retrying = await plantRequest(gateway, beta, {
    status: 'retrying',
    ageMs: 7 * MINUTE,
    mode: 'live',
    attempts: [{ outcome: 'failed', code: 'upstream_rate_limited', finishedAgoMs: MINUTE }],
  });
  const query = async (text: string, values: unknown[] = []) => (await gateway.pool.query(text, values)).rows;

  t.same(
    (await query('select project, mode, status, requests::int from gateway.request_counts order by project, mode, status')),
    [
      { project: 'alpha', mode: 'test', status: 'completed', requests: 2 },
      { project: 'alpha', mode: 'test', status: 'failed', requests: 2 },
      { project: 'beta', mode: 'live', status: 'queued', requests: 1 },
      { project: 'beta', mode: 'live', status: 'retrying', requests: 1 },
    ],
  );

  const waiting = await query('select * from gateway.waiting_requests order by created_at');
  t.same(waiting.map((row) => row.id), [oldestWaiting.id, retrying.id], 'unfinished only, oldest first');
  t.match(waiting[1], { project: 'beta', status: 'retrying', attempts: 1, last_error_code: 'upstream_rate_limited' });
  t.ok(waiting[0].waiting_for.minutes >= 19, 'waiting_for is the time since acceptance');

  t.same(
    (await query('select error_code, mode, failed_attempts::int, requests::int from gateway.recent_errors order by failed_attempts desc, error_code')),
    [
      { error_code: 'upstream_bad_request', mode: 'test', failed_attempts: 1, requests: 1 },
      { error_code: 'upstream_rate_limited', mode: 'live', failed_attempts: 1, requests: 1 },
      { error_code: 'upstream_server_error', mode: 'test', failed_attempts: 1, requests: 1 },
    ],
    'the last hour only: the failure of two hours ago is not there',
  );

  const history = await query('select * from gateway.attempt_history where request_id = $1 order by attempt_number', [completed.id]);
  t.match(history, [
    { attempt_number: 1, outcome: 'failed', error_code: 'upstream_server_error', request_status: 'completed' },
    { attempt_number: 2, outcome: 'succeeded', error_code: null, upstream_status: 200 },
  ]);
});

t.test("every query of docs/operations.md's psql section runs as written", async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  await plantRequest(gateway, key, { status: 'completed', attempts: [{ outcome: 'succeeded' }] });
  const operations = await readFile(new URL('../docs/operations.md', import.meta.url), 'utf8');
  const start = operations.indexOf('\n## Inspecting with psql\n');
  t.ok(start >= 0, 'the section is there');
  const end = operations.indexOf('\n## ', start + 1);
  const section = operations.slice(start, end === -1 ? undefined : end);
  const blocks = [...section.matchAll(/```sql\n([\s\S]*?)```/g)].map((match) => match[1]!);
  const statements = blocks.flatMap((block) =>
    block
      .split(/;\s*\n/)
      .map((statement) => statement.replace(/^--.*$/gm, '').trim())
      .filter(Boolean),
  );
  t.ok(statements.length >= 9, `${statements.length} queries found`);
  for (const statement of statements) {
    await t.resolves(gateway.pool.query(statement), statement.split('\n')[0]!);
  }
});

t.test('gateway.request_id_floor agrees with the ids the gateway makes', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  for (const ms of [0, 1, 61, 1_795_340_651_123, Date.now(), Date.UTC(2100, 0, 1)]) {
    const { rows } = await gateway.pool.query('select gateway.request_id_floor(to_timestamp($1::float8 / 1000)) as floor', [ms]);
    t.equal(rows[0].floor, requestIdFloor(ms), `at ${ms} ms`);
    t.ok(newRequestId(ms) >= rows[0].floor, 'ids of that millisecond sort from it');
    if (ms > 0) t.ok(newRequestId(ms - 1) < rows[0].floor, 'ids of the millisecond before sort below it');
  }
});
