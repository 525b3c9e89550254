// GET /metrics (Prometheus): after a known mix of requests, every family has the right counts,
// no label carries a key, secret or project; it is served on METRICS_PORT, or on PORT only
// behind METRICS_TOKEN, and never otherwise; the gauges read from the database cost one read
// per few seconds however often they are scraped, and keep their last figures while it is out
// of reach.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { createDb, createPool } from '../src/db/pool.ts';
import { createLogger } from '../src/logger.ts';
import { Metrics } from '../src/metrics.ts';
import { PATTERN_QUEUES_LOCK } from '../src/lanes/repository.ts';
import { countUnfinishedByStatus } from '../src/requests/inspection.ts';
import { oldestUnfinishedMessageAge } from '../src/webhooks/repository.ts';
import { createTestDatabase } from './helpers/database.ts';
import { startTestGateway } from './helpers/gateway.ts';
import { clientFor, send, userMessage } from './helpers/http.ts';
import { parseMetrics } from './helpers/metrics.ts';
import { apiWaitingOnLock, isTerminal, waitForRow } from './helpers/rows.ts';
import { startTcpProxy } from './helpers/tcp-proxy.ts';
import { completionFor, startFakeUpstream } from './helpers/upstream.ts';
import { until } from './helpers/wait.ts';

const scrape = async (url: string, headers: Record<string, string> = {}) =>
  parseMetrics((await send(url, { path: '/metrics', headers })).text);

t.test('each metric family counts what happened', async (t) => {
  const upstream = await startFakeUpstream(t, (call) => ({ status: 200, json: completionFor(call.body) }));
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl, METRICS_PORT: '0' } });
  const testKey = await gateway.createKey({ project: 'metrics-project', mode: 'test' });
  const liveKey = await gateway.createKey({ project: 'metrics-project', mode: 'live' });
  const test = clientFor(gateway.url, testKey);
  const live = clientFor(gateway.url, liveKey);

  const ids: string[] = [];
  for (const [index, model] of ['test-echo', 'test-echo', 'test-error-400'].entries()) {
    ids.push((await test.post({ model, messages: userMessage('secret message content'), idempotency_key: `k${index}` })).body.id);
  }
  ids.push((await live.post({ model: 'gpt-x', messages: userMessage() })).body.id);
  await test.post({ model: 'test-echo', messages: userMessage('secret message content'), idempotency_key: 'k0' }); // a replay
  await test.post({ model: 'test-echo', messages: [] }); // 400
  await send(gateway.url, { path: '/v1/chat/completions', body: { model: 'm', messages: userMessage() } }); // 401
  for (const id of ids) await waitForRow(gateway.db, id, isTerminal);
  await test.get(ids[0]!);
  await test.get('req_00000000000000000000'); // 404
  // The worker counts a completion's tokens once its finish statement has answered, which can be
  // a moment after the row shows the request ended.
  const liveCompletionTokens = 'gateway_tokens_total{mode="live",upstream="default",model="*",kind="completion"}';
  await until(async () => (await scrape(gateway.metricsUrl)).get(liveCompletionTokens) === 3, 'the worker to count the live completion\'s tokens');

  const text = (await send(gateway.metricsUrl, { path: '/metrics' })).text;
  const m = parseMetrics(text);
  const value = (sample: string) => m.get(sample) ?? 0;
  const post = 'method="POST",route="/v1/chat/completions"';
  t.equal(value(`gateway_http_requests_total{${post},status="202"}`), 5, '5 acknowledgements (one a replay)');
  t.equal(value(`gateway_http_requests_total{${post},status="400"}`), 1);
  t.equal(value(`gateway_http_requests_total{${post},status="401"}`), 1);
  t.equal(value('gateway_http_requests_total{method="GET",route="/v1/requests/:id",status="200"}'), 1);
  t.equal(value('gateway_http_requests_total{method="GET",route="/v1/requests/:id",status="404"}'), 1);
  t.equal(value(`gateway_http_request_duration_seconds_count{${post}}`), 7, 'every POST timed');
  t.equal(value('gateway_requests_accepted_total{mode="test"}'), 3, 'replays are not counted');
  t.equal(value('gateway_requests_accepted_total{mode="live"}'), 1);
  t.equal(value('gateway_attempts_total{mode="test",outcome="succeeded",code="none"}'), 2);
  t.equal(value('gateway_attempts_total{mode="test",outcome="failed",code="upstream_bad_request"}'), 1);
  t.equal(value('gateway_attempts_total{mode="live",outcome="succeeded",code="none"}'), 1);
  t.equal(value('gateway_upstream_duration_seconds_count{mode="test",outcome="succeeded"}'), 2);
  t.equal(value('gateway_upstream_duration_seconds_count{mode="live",outcome="succeeded"}'), 1);
  t.equal(value('gateway_insert_group_size_sum'), 5, 'five requests written (the replay among them)');
  // One insert statement per POST (each was answered before the next was sent); the four attempts
  // were recorded in one to four finish statements, as they came.
  t.equal(value('gateway_db_write_duration_seconds_count{write="accept"}'), 5, 'each insert statement timed');
  const finishWrites = value('gateway_db_write_duration_seconds_count{write="finish"}');
  t.ok(finishWrites >= 1 && finishWrites <= 4, `the finish statements timed (${finishWrites})`);
  t.ok(value('gateway_db_write_duration_seconds_sum{write="accept"}') > 0 && value('gateway_db_write_duration_seconds_sum{write="finish"}') > 0, 'each took some time');
  t.equal(value('gateway_waiters'), 0);
  t.equal(m.get('gateway_upstream_calls_in_flight{mode="test"}'), 0, 'no call left in flight');
  t.equal(m.get('gateway_upstream_calls_in_flight{mode="live"}'), 0);
  t.equal(value('gateway_tokens_total{mode="live",upstream="default",model="*",kind="prompt"}'), 3, 'tokens of the completion, by mode, upstream and model');
  t.equal(value('gateway_tokens_total{mode="live",upstream="default",model="*",kind="completion"}'), 3);
  t.ok(m.has('gateway_db_pool_connections{pool="api",state="idle"}'));
  t.ok(m.has('gateway_db_pool_connections{pool="worker",state="in_use"}'));
  t.equal(value('gateway_requests{status="queued",mode="test"}'), 0, 'nothing left in the queue');
  t.ok(m.has('gateway_process_resident_memory_bytes'), 'process metrics too');

  for (const secret of [testKey.api_key, testKey.signing_secret, liveKey.api_key, 'metrics-project', 'secret message content', testKey.id]) {
    t.notOk(text.includes(secret), `no "${secret.slice(0, 12)}..." in the metrics`);
  }
});

t.test('the accept write of a request that creates its queue is timed to its commit, its transaction\'s waits included', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { METRICS_PORT: '0' } });
  const live = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  // A model only the default upstream's pattern serves: its queue is created in the transaction
  // that stores its first request, behind the lock that such creations take in turn, held here.
  const locker = await gateway.pool.connect();
  t.teardown(() => locker.release());
  await locker.query('select pg_advisory_lock($1::bigint)', [PATTERN_QUEUES_LOCK]);
  const posted = live.post({ model: 'gpt-new', messages: userMessage() });
  await until(async () => (await apiWaitingOnLock(gateway.pool)) === 1, 'the creation to wait on the lock');
  await sleep(1_000);
  await locker.query('select pg_advisory_unlock($1::bigint)', [PATTERN_QUEUES_LOCK]);
  t.equal((await posted).status, 202);

  const m = await scrape(gateway.metricsUrl);
  t.equal(m.get('gateway_db_write_duration_seconds_count{write="accept"}'), 1, 'one accept write');
  const seconds = m.get('gateway_db_write_duration_seconds_sum{write="accept"}')!;
  t.ok(seconds >= 1, `its second behind the lock is in it (${seconds} s)`);
});

t.test('the queue and the waiters, as they are', async (t) => {
  const api = await startTestGateway(t, { role: 'api', env: { WAIT_TIMEOUT_MS: '20000', METRICS_PORT: '0' } });
  const client = clientFor(api.url, await api.createKey());
  for (let i = 0; i < 3; i++) await client.post({ model: 'test-echo', messages: userMessage() });
  const waiting = client.post({ model: 'test-echo', messages: userMessage(), wait: true });
  // (A wait=true request is watched before its row is stored: the row is waited for too.)
  const stored = async () => Number((await api.pool.query('select count(*) as count from gateway.requests')).rows[0].count);
  await until(async () => api.waiters!.size > 0 && (await stored()) === 4, 'the request to be stored and wait');
  const m = await scrape(api.metricsUrl);
  t.equal(m.get('gateway_requests{status="queued",mode="test"}'), 4, 'no worker: four queued');
  t.equal(m.get('gateway_requests{status="processing",mode="test"}'), 0);
  t.equal(m.get('gateway_waiters'), 1);

  // A worker-only process serves its own metrics.
  const worker = await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env: { METRICS_PORT: '0' } });
  t.equal((await waiting).status, 200);
  const { rows } = await api.pool.query('select id from gateway.requests');
  for (const row of rows) await waitForRow(api.db, row.id, isTerminal);
  const workerMetrics = await scrape(worker.metricsUrl);
  t.equal(workerMetrics.get('gateway_attempts_total{mode="test",outcome="succeeded",code="none"}'), 4);
  t.equal(workerMetrics.get('gateway_requests{status="queued",mode="test"}'), 0);
  t.equal((await send(worker.url, { path: '/v1/chat/completions', body: {} })).status, 404, 'a worker serves no API');
});

t.test('without METRICS_PORT nor METRICS_TOKEN, no port serves /metrics; health stays on PORT', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const worker = await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl });
  const all = await startTestGateway(t, { databaseUrl: api.databaseUrl });
  for (const [name, gateway] of [['api', api], ['worker', worker], ['all', all]] as const) {
    t.equal(gateway.metricsUrl, '', `--role ${name}: no metrics port`);
    const metrics = await send(gateway.url, { path: '/metrics' });
    t.equal(metrics.status, 404, `--role ${name}: no /metrics on PORT`);
    t.equal(metrics.body.error.code, 'route_not_found');
    t.equal((await send(gateway.url, { path: '/healthz' })).status, 200, `--role ${name}: /healthz on PORT`);
    t.equal((await send(gateway.url, { path: '/readyz' })).status, 200, `--role ${name}: /readyz on PORT`);
  }
});

t.test('METRICS_PORT serves /metrics apart from PORT, behind METRICS_TOKEN when it is set too', async (t) => {
  const env = { METRICS_PORT: '0', METRICS_TOKEN: 'scrape-token-456' };
  const api = await startTestGateway(t, { role: 'api', env });
  const worker = await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env });
  for (const [name, gateway] of [['api', api], ['worker', worker]] as const) {
    t.not(gateway.metricsUrl, '', `--role ${name}: a metrics url`);
    t.not(new URL(gateway.metricsUrl).port, new URL(gateway.url).port, `--role ${name}: a port of its own`);
    t.equal((await send(gateway.url, { path: '/metrics', headers: { authorization: 'Bearer scrape-token-456' } })).status, 404, `--role ${name}: none on PORT`);
    t.equal((await send(gateway.metricsUrl, { path: '/metrics' })).status, 401, `--role ${name}: the token is required`);
    const right = await send(gateway.metricsUrl, { path: '/metrics', headers: { authorization: 'Bearer scrape-token-456' } });
    t.equal(right.status, 200, `--role ${name}: served with the token`);
    t.match(right.text, /# TYPE gateway_http_requests_total counter/);
    t.equal((await send(gateway.metricsUrl, { path: '/healthz' })).status, 404, `--role ${name}: the metrics port serves metrics only`);
  }
  t.equal((await send(worker.url, { path: '/healthz' })).status, 200, 'the worker\'s health stays on PORT');
});

t.test('METRICS_TOKEN alone: PORT serves /metrics, and requires it', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { METRICS_TOKEN: 'scrape-token-123' } });
  const none = await send(gateway.url, { path: '/metrics' });
  t.equal(none.status, 401);
  t.equal(none.body.error.code, 'missing_api_key');
  const wrong = await send(gateway.url, { path: '/metrics', headers: { authorization: 'Bearer nope' } });
  t.equal(wrong.status, 401);
  t.equal(wrong.body.error.code, 'invalid_api_key');
  const right = await send(gateway.url, { path: '/metrics', headers: { authorization: 'Bearer scrape-token-123' } });
  t.equal(right.status, 200);
  t.match(right.headers.get('content-type'), /^text\/plain/);
  t.match(right.text, /# TYPE gateway_http_requests_total counter/);

  // A worker-only process likewise, on its health port.
  const worker = await startTestGateway(t, { role: 'worker', databaseUrl: gateway.databaseUrl, env: { METRICS_TOKEN: 'scrape-token-123' } });
  t.equal((await send(worker.url, { path: '/metrics' })).status, 401);
  t.equal((await send(worker.url, { path: '/metrics', headers: { authorization: 'Bearer scrape-token-123' } })).status, 200);
});

t.test('the gauges read from the database are read once per few seconds, by one scrape at a time', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const client = clientFor(api.url, await api.createKey());
  // A pool of its own, to count the reads the scrapes make.
  const pool = createPool(api.databaseUrl, { max: 10, applicationName: 'metrics-reads-test', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  let reads = 0;
  pool.on('acquire', () => reads++);
  const metrics = new Metrics({ databaseGaugeTtlMs: 1_000 });
  metrics.watchQueue(() => countUnfinishedByStatus(createDb(pool)));
  metrics.watchWebhooks(() => oldestUnfinishedMessageAge(createDb(pool)));

  await client.post({ model: 'test-echo', messages: userMessage() });
  const scrapes = await Promise.all(Array.from({ length: 20 }, () => metrics.render()));
  t.equal(reads, 2, '20 scrapes at once: one read of each gauge');
  t.ok(scrapes.every((text) => parseMetrics(text).get('gateway_requests{status="queued",mode="test"}') === 1), 'each saw the one queued request');

  await client.post({ model: 'test-echo', messages: userMessage() });
  for (let i = 0; i < 5; i++) await metrics.render();
  t.equal(reads, 2, 'five more scrapes within the second: no read');
  t.equal(parseMetrics(await metrics.render()).get('gateway_requests{status="queued",mode="test"}'), 1, 'the figure kept');

  await new Promise((resolve) => setTimeout(resolve, 1_100));
  t.equal(parseMetrics(await metrics.render()).get('gateway_requests{status="queued",mode="test"}'), 2, 'read again once it is old');
  t.equal(reads, 4);
});

t.test('with the database out of reach, /metrics still answers every metric, the gauges read from it with their last figures', async (t) => {
  const proxy = await startTcpProxy(t, await createTestDatabase(t));
  const gateway = await startTestGateway(t, { role: 'api', databaseUrl: proxy.url, env: { METRICS_TOKEN: 'scrape-token-789' } });
  await clientFor(gateway.url, await gateway.createKey()).post({ model: 'test-echo', messages: userMessage() });
  const scrapeWithToken = () => send(gateway.url, { path: '/metrics', headers: { authorization: 'Bearer scrape-token-789' } });
  const before = parseMetrics((await scrapeWithToken()).text);
  t.equal(before.get('gateway_requests{status="queued",mode="test"}'), 1);

  proxy.cut();
  t.equal((await send(gateway.url, { path: '/readyz' })).status, 503, 'the database is out of reach');
  // Past the 5 s for which a gauge's figure is kept: the next scrape reads the database again.
  await new Promise((resolve) => setTimeout(resolve, 5_100));
  for (let i = 0; i < 2; i++) {
    const during = await scrapeWithToken();
    t.equal(during.status, 200, `scrape ${i + 1} during the outage answers`);
    const samples = parseMetrics(during.text);
    t.ok(samples.get('gateway_http_requests_total{method="GET",route="/readyz",status="503"}'), 'with the process\'s own metrics');
    t.equal(samples.get('gateway_requests{status="queued",mode="test"}'), 1, 'and the queue as last read');
    t.equal(samples.get('gateway_webhook_oldest_pending_seconds'), before.get('gateway_webhook_oldest_pending_seconds'));
  }
  t.notOk(gateway.logs.some((line) => line.includes('unhandled')), 'nothing unhandled');
});
