// 1,000 wait=false requests sent at once all complete: exactly 1,000 rows, one attempt each,
// none lost, none duplicated.
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';

t.test('1,000 concurrent test-mode requests: all completed, each exactly once', async (t) => {
  const gateway = await startTestGateway(t, { env: { LOG_LEVEL: 'warn', WORKER_CONCURRENCY: '32' } });
  const client = clientFor(gateway.url, await gateway.createKey());
  const answers = await Promise.all(
    Array.from({ length: 1_000 }, (_, i) => client.post({ model: 'test-echo', messages: userMessage(`request ${i}`) })),
  );
  t.same(new Set(answers.map((answer) => answer.status)), new Set([202]), 'all acknowledged');
  const ids = new Set(answers.map((answer) => answer.body.id as string));
  t.equal(ids.size, 1_000, '1,000 distinct ids');

  const deadline = Date.now() + 60_000;
  let completed = 0;
  while (completed < 1_000 && Date.now() < deadline) {
    await new Promise((resolve) => setTimeout(resolve, 100));
    completed = Number((await gateway.pool.query(`select count(*) from gateway.requests where status = 'completed'`)).rows[0].count);
  }
  const { rows } = await gateway.pool.query(
    `select id, status, attempts, (select count(*) from gateway.request_attempts a where a.request_id = r.id)::int as attempt_rows,
            result->'choices'->0->'message'->>'content' as content
     from gateway.requests r`,
  );
  t.equal(rows.length, 1_000, 'exactly 1,000 rows');
  t.same(new Set(rows.map((row) => row.id)), ids, 'the ids the clients received, no others');
  t.ok(rows.every((row) => row.status === 'completed'), 'every one completed');
  t.ok(rows.every((row) => row.attempts === 1 && row.attempt_rows === 1), 'each in exactly one attempt');
  t.equal(new Set(rows.map((row) => row.content)).size, 1_000, 'each answered with its own message');
});
