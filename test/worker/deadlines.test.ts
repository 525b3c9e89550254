// The deadline expiry's statement and loop (worker/deadlines.ts), run straight on a database
// whose requests are planted in every state, with no worker of its own: what it fails, what it
// records of a running attempt, and what it leaves alone.
import { Writable } from 'node:stream';
import t from 'tap';
import { createLogger } from '../../src/logger.ts';
import { Metrics } from '../../src/metrics.ts';
import { expireRequests } from '../../src/worker/deadlines-repository.ts';
import { expireOverdue } from '../../src/worker/deadlines.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { plantRequest } from '../helpers/populate.ts';
import { attemptRows, requestRow } from '../helpers/rows.ts';
import { addTestEndpoint, messagesOf, metricValue } from '../webhooks/support.ts';

/** Sets the request's deadline `inMs` from now (negative: passed). */
async function deadlineIn(gateway: TestGateway, id: string, inMs: number): Promise<void> {
  await gateway.pool.query(`update gateway.requests set deadline_at = now() + $2::float8 * interval '1 millisecond' where id = $1`, [id, inMs]);
}

t.test('the expiry fails the unfinished requests past their deadline, oldest deadline first, and nothing else', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  await addTestEndpoint(gateway, { url: 'http://127.0.0.1:9/hooks' });
  const queued = await plantRequest(gateway, key, { status: 'queued' });
  const retrying = await plantRequest(gateway, key, { status: 'retrying', attempts: [{ outcome: 'failed', code: 'upstream_server_error' }] });
  const processing = await plantRequest(gateway, key, {
    status: 'processing',
    attempts: [{ outcome: 'failed', code: 'upstream_timeout' }, { outcome: 'running' }],
  });
  const notYet = await plantRequest(gateway, key, { status: 'queued' });
  const completed = await plantRequest(gateway, key, { status: 'completed', attempts: [{ outcome: 'succeeded' }] });
  await deadlineIn(gateway, queued.id, -3_000);
  await deadlineIn(gateway, retrying.id, -2_000);
  await deadlineIn(gateway, processing.id, -1_000);
  await deadlineIn(gateway, notYet.id, 3_600_000);
  await deadlineIn(gateway, completed.id, -3_600_000);

  const firstBatch = await expireRequests(gateway.db, 2);
  t.same(
    firstBatch.sort((a, b) => a.from.localeCompare(b.from)),
    [
      { mode: 'test', from: 'queued', count: 1 },
      { mode: 'test', from: 'retrying', count: 1 },
    ],
    'a batch of 2 takes the two oldest deadlines',
  );
  const lines: string[] = [];
  const logger = createLogger({ logLevel: 'info' }, new Writable({ write: (chunk, _encoding, done) => (lines.push(String(chunk)), done()) }));
  const metrics = new Metrics();
  t.equal(await expireOverdue({ db: gateway.db, metrics, logger }), 1, 'the loop takes the rest');
  t.equal(await expireOverdue({ db: gateway.db, metrics, logger }), 0, 'and then finds none');
  t.equal(await metricValue(metrics, 'gateway_requests_expired_total{mode="test",from="processing"}'), 1);
  t.match(JSON.parse(lines.join('')), { level: 'info', component: 'deadlines', expired: 1, msg: 'requests failed: their deadline passed' });

  for (const planted of [queued, retrying, processing]) {
    const row = await requestRow(gateway.db, planted.id);
    t.match(row, { status: 'failed', last_error_code: 'deadline_exceeded', next_attempt_at: null }, `${planted.status}: failed`);
    t.ok(row?.finished_at && row.finished_at.getTime() === row.updated_at.getTime(), `${planted.status}: finished now`);
    t.match(await messagesOf(gateway.db, planted.id), [{ event_type: 'request.failed' }], `${planted.status}: its webhook event written`);
  }
  t.match(await attemptRows(gateway.db, processing.id), [
    { attempt_number: 1, outcome: 'failed', error_code: 'upstream_timeout' },
    { attempt_number: 2, outcome: 'failed', error_code: 'deadline_exceeded', error_detail: 'the request\'s deadline passed during the call' },
  ], 'the running attempt is recorded as cut short by the deadline; the one before is left as it was');
  const cut = (await attemptRows(gateway.db, processing.id))[1]!;
  t.ok(cut.finished_at && cut.duration_ms !== null && cut.duration_ms >= 100, 'with its end and its duration');
  t.match(await attemptRows(gateway.db, retrying.id), [{ outcome: 'failed', error_code: 'upstream_server_error' }]);

  t.match(await requestRow(gateway.db, notYet.id), { status: 'queued', last_error_code: null, finished_at: null }, 'a deadline to come: left');
  t.match(await requestRow(gateway.db, completed.id), { status: 'completed', last_error_code: null }, 'a finished request: left');
  t.same(await messagesOf(gateway.db, completed.id), []);
});
