// Retention: finished requests past RETENTION_DAYS are deleted with their attempts (their
// idempotency keys freed); nothing unfinished or younger is touched; BODY_RETENTION_HOURS
// drops bodies and keeps records.
import t from 'tap';
import { loadConfig } from '../../src/config.ts';
import { createLogger } from '../../src/logger.ts';
import { cleanupNoncesTask } from '../../src/worker/cleanup-nonces.ts';
import { retentionTask } from '../../src/worker/retention.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { plantRequest } from '../helpers/populate.ts';
import { requestRow } from '../helpers/rows.ts';
import { addTestEndpoint, messagesOf } from '../webhooks/support.ts';

const DAY = 24 * 3_600_000;
const silent = createLogger({ logLevel: 'silent' });

t.test('only finished requests older than RETENTION_DAYS go, with their attempts', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const old = { ageMs: 31 * DAY, attempts: [{ outcome: 'succeeded' as const }] };
  const doomed = [
    await plantRequest(gateway, key, { status: 'completed', ...old, idempotencyKey: 'reusable' }),
    await plantRequest(gateway, key, { status: 'failed', ageMs: 40 * DAY, attempts: [{ outcome: 'failed', code: 'upstream_bad_request' }] }),
  ];
  const kept = [
    await plantRequest(gateway, key, { status: 'completed', ageMs: 29 * DAY, attempts: [{ outcome: 'succeeded' }] }),
    await plantRequest(gateway, key, { status: 'queued', ageMs: 45 * DAY }),
    await plantRequest(gateway, key, { status: 'retrying', ageMs: 45 * DAY, attempts: [{ outcome: 'failed', code: 'upstream_timeout' }] }),
    await plantRequest(gateway, key, { status: 'processing', ageMs: 45 * DAY, attempts: [{ outcome: 'running' }] }),
    await plantRequest(gateway, key, { status: 'completed', ageMs: 0 }),
  ];
  // More than one batch of old finished requests.
  for (let i = 0; i < 1_100; i += 100) {
    await gateway.pool.query(
      `insert into gateway.requests (id, project_id, mode, api_key_id, status, attempts, model, body, body_sha256, result, created_at, finished_at)
       select 'req_00000' || lpad((${i} + n)::text, 21, '0'), project_id, 'test', id, 'completed', 1, 'm', '{}', '\\x00', '{}', now() - interval '60 days', now() - interval '60 days'
       from gateway.api_keys, generate_series(1, 100) as n where id = $1`,
      [key.id],
    );
  }

  await retentionTask({ db: gateway.db, config: { retentionDays: 30, bodyRetentionHours: undefined }, logger: silent })({}, {} as never);

  const { rows } = await gateway.pool.query('select id from gateway.requests order by id');
  t.same(rows.map((row) => row.id).sort(), kept.map((request) => request.id).sort(), 'exactly the young and the unfinished remain');
  const attempts = await gateway.pool.query('select distinct request_id from gateway.request_attempts');
  t.same(
    attempts.rows.map((row) => row.request_id).sort(),
    [kept[0]!.id, kept[2]!.id, kept[3]!.id].sort(),
    'the deleted requests\' attempts went with them',
  );
  t.notOk(doomed.some((request) => rows.some((row) => row.id === request.id)));

  // The idempotency key of a deleted request is free: the same key with another body is new.
  const fresh = await clientFor(gateway.url, await gateway.createKey({ project: 'test-project' })).post({
    model: 'another-model',
    messages: userMessage('a different body'),
    idempotency_key: 'reusable',
  });
  t.equal(fresh.status, 202, 'not 422: the key was freed');
  t.equal(fresh.headers.get('idempotent-replayed'), null);
});

t.test('BODY_RETENTION_HOURS drops old finished bodies and keeps the records', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const dropped = await plantRequest(gateway, key, { status: 'completed', ageMs: 3 * 3_600_000 });
  const failedDropped = await plantRequest(gateway, key, { status: 'failed', ageMs: 5 * 3_600_000 });
  const young = await plantRequest(gateway, key, { status: 'completed', ageMs: 30 * 60_000 });
  const unfinished = await plantRequest(gateway, key, { status: 'retrying', ageMs: 4 * 3_600_000 });
  const task = retentionTask({ db: gateway.db, config: { retentionDays: 30, bodyRetentionHours: 2 }, logger: silent });

  await task({}, {} as never);
  const bodies = async () =>
    Object.fromEntries(
      (await gateway.pool.query('select id, body is not null as kept, status from gateway.requests')).rows.map((row) => [row.id, row.kept]),
    );
  t.same(await bodies(), {
    [dropped.id]: false,
    [failedDropped.id]: false,
    [young.id]: true,
    [unfinished.id]: true,
  });
  const { rows } = await gateway.pool.query('select result, body_sha256 from gateway.requests where id = $1', [dropped.id]);
  t.ok(rows[0].result && rows[0].body_sha256, 'the record, its result and its body hash stay');

  const cursor = async () =>
    (await gateway.pool.query(`select last_request_id from gateway.retention_cursors where task = 'drop_bodies'`)).rows[0]
      ?.last_request_id;
  t.equal(await cursor(), failedDropped.id, 'the cursor waits before the unfinished request, the oldest one past it');

  // Once it has finished, the next run drops its body too, and those that came of age since.
  await gateway.pool.query(
    `update gateway.requests set status = 'failed', finished_at = now(), last_error_code = 'upstream_server_error' where id = $1`,
    [unfinished.id],
  );
  const later = await plantRequest(gateway, key, { status: 'completed', ageMs: 2.5 * 3_600_000 });
  await task({}, {} as never);
  t.same(await bodies(), {
    [dropped.id]: false,
    [failedDropped.id]: false,
    [young.id]: true,
    [unfinished.id]: false,
    [later.id]: false,
  });
  t.equal(await cursor(), later.id, 'the cursor stopped at the newest id past the cutoff');
});

t.test('BODY_RETENTION_HOURS: a request unfinished for a day past the cutoff no longer holds the task back', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const stuck = await plantRequest(gateway, key, { status: 'queued', ageMs: 30 * 3_600_000 });
  const after = await plantRequest(gateway, key, { status: 'completed', ageMs: 3 * 3_600_000 });
  const task = retentionTask({ db: gateway.db, config: { retentionDays: 30, bodyRetentionHours: 2 }, logger: silent });
  await task({}, {} as never);
  const { rows } = await gateway.pool.query('select id, body is not null as kept from gateway.requests order by id');
  t.same(rows, [{ id: stuck.id, kept: true }, { id: after.id, kept: false }], 'passed over, its body kept; the rest go on');
  const cursor = await gateway.pool.query(`select last_request_id from gateway.retention_cursors where task = 'drop_bodies'`);
  t.equal(cursor.rows[0].last_request_id, after.id);
});

t.test('a finished request past RETENTION_DAYS whose webhook events are not delivered yet stays until they are', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  await addTestEndpoint(gateway, { url: 'http://127.0.0.1:9/hooks' });
  const gone = await addTestEndpoint(gateway, { url: 'http://127.0.0.1:9/gone' });
  // Accepted 31 days ago and failed only now (a deadline of 30 days): its event is to be sent.
  const late = await plantRequest(gateway, key, { status: 'processing', ageMs: 31 * DAY, attempts: [{ outcome: 'running' }] });
  const toDisabled = await plantRequest(gateway, key, { status: 'processing', ageMs: 31 * DAY, attempts: [{ outcome: 'running' }] });
  await gateway.pool.query(
    `update gateway.requests set status = 'failed', last_error_code = 'deadline_exceeded', finished_at = now(), updated_at = now()
     where id = any($1)`,
    [[late.id, toDisabled.id]],
  );
  // An endpoint disabled (410) never sends its pending events: they hold nothing back.
  await gateway.pool.query(`delete from gateway.webhook_messages where request_id = $1 and endpoint_id <> $2`, [toDisabled.id, gone.id]);
  await gateway.pool.query(`delete from gateway.webhook_messages where request_id = $1 and endpoint_id = $2`, [late.id, gone.id]);
  await gateway.pool.query(`update gateway.webhook_endpoints set disabled_at = now(), disabled_reason = '410' where id = $1`, [gone.id]);
  const [message] = await messagesOf(gateway.db, late.id);
  t.match(message, { event_type: 'request.failed', status: 'pending' });
  const task = retentionTask({ db: gateway.db, config: { retentionDays: 30, bodyRetentionHours: undefined }, logger: silent });

  await task({}, {} as never);
  t.equal(await requestRow(gateway.db, toDisabled.id), undefined, 'its event pending for a disabled endpoint: deleted');
  t.match(await requestRow(gateway.db, late.id), { status: 'failed' }, 'kept while its event waits for its tries');
  t.match(await messagesOf(gateway.db, late.id), [{ id: message!.id, status: 'pending' }], 'its event too');

  await gateway.pool.query(`update gateway.webhook_messages set status = 'delivered', next_try_at = null, finished_at = now() where id = $1`, [
    message!.id,
  ]);
  await task({}, {} as never);
  t.equal(await requestRow(gateway.db, late.id), undefined, 'deleted once its event is delivered');
  t.same(await messagesOf(gateway.db), []);
});

t.test('the longest retentions the settings take keep every finished request and body', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const planted = [
    await plantRequest(gateway, key, { status: 'completed', ageMs: 40 * DAY, attempts: [{ outcome: 'succeeded' }] }),
    await plantRequest(gateway, key, { status: 'failed', ageMs: DAY, attempts: [{ outcome: 'failed', code: 'upstream_bad_request' }] }),
    await plantRequest(gateway, key, { status: 'completed', ageMs: 60_000 }),
  ];
  // 36500 days (RETENTION_DAYS's largest) and a million hours reach back before 1970.
  await retentionTask({ db: gateway.db, config: { retentionDays: 36_500, bodyRetentionHours: 1_000_000 }, logger: silent })({}, {} as never);

  const { rows } = await gateway.pool.query('select id, body is not null as kept from gateway.requests order by id');
  t.same(rows, planted.map((request) => ({ id: request.id, kept: true })), 'every request stays, with its body');
});

t.test('BODY_RETENTION_HOURS at the largest value the settings take: the task runs, and keeps the bodies', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const old = await plantRequest(gateway, key, { status: 'completed', ageMs: 10 * DAY, attempts: [{ outcome: 'succeeded' }] });
  const hours = loadConfig({ BODY_RETENTION_HOURS: String(Number.MAX_SAFE_INTEGER) }).bodyRetentionHours;
  t.equal(hours, Number.MAX_SAFE_INTEGER, 'a value the settings accept');

  await retentionTask({ db: gateway.db, config: { retentionDays: 30, bodyRetentionHours: hours }, logger: silent })({}, {} as never);
  const { rows } = await gateway.pool.query('select body is not null as kept from gateway.requests where id = $1', [old.id]);
  t.same(rows, [{ kept: true }]);
});

t.test('a worker stopping ends the retention and the nonce cleanup between two batches', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  await gateway.pool.query(
    `insert into gateway.requests (id, project_id, mode, api_key_id, status, attempts, model, body, body_sha256, result, created_at, finished_at)
     select 'req_00000' || lpad(n::text, 21, '0'), project_id, 'test', id, 'completed', 1, 'm', '{}', '\\x00', '{}', now() - interval '60 days', now() - interval '60 days'
     from gateway.api_keys, generate_series(1, 2500) as n where id = $1`,
    [key.id],
  );
  await gateway.pool.query(
    `insert into gateway.signature_nonces (api_key_id, nonce, expires_at)
     select $1, 'nonce' || lpad(n::text, 16, '0'), now() - interval '1 hour' from generate_series(1, 12000) as n`,
    [key.id],
  );
  const count = async (table: string) => Number((await gateway.pool.query(`select count(*) from gateway.${table}`)).rows[0].count);
  // graphile-worker aborts its jobs' signal when the pool is stopping and SHUTDOWN_GRACE_MS is over.
  const stopping = { abortSignal: AbortSignal.abort() } as never;
  await retentionTask({ db: gateway.db, config: { retentionDays: 30, bodyRetentionHours: 2 }, logger: silent })({}, stopping);
  await cleanupNoncesTask({ db: gateway.db, logger: silent })({}, stopping);
  t.ok((await count('requests')) > 0, 'the retention left the rest to its next run');
  t.ok((await count('signature_nonces')) > 0, 'the nonce cleanup too');

  const going = { abortSignal: new AbortController().signal } as never;
  await retentionTask({ db: gateway.db, config: { retentionDays: 30, bodyRetentionHours: 2 }, logger: silent })({}, going);
  await cleanupNoncesTask({ db: gateway.db, logger: silent })({}, going);
  t.equal(await count('requests'), 0, 'a run not stopped does it all');
  t.equal(await count('signature_nonces'), 0);
});
