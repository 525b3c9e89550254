// Routing by model (UPSTREAMS_FILE), what is refused before anything is stored, and usage: the
// tokens of each completion stored with its request, summed by gateway.usage_daily, corrected
// into its lane's token allowance, and counted in the metrics.
import t from 'tap';
import { LANE_PACING } from '../../src/lanes/repository.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { countRows } from '../helpers/rows.ts';
import { until } from '../helpers/wait.ts';
import { completionFor, startFakeUpstream } from '../helpers/upstream.ts';
import { upstreamsFile } from '../helpers/upstreams-file.ts';

t.test('a live request runs on the first of its model\'s deployments, with that upstream\'s key', async (t) => {
  const alpha = await startFakeUpstream(t);
  const beta = await startFakeUpstream(t);
  const file = await upstreamsFile(t, [
    { name: 'alpha', base_url: alpha.baseUrl, api_key_env: 'ALPHA_KEY', models: ['gpt-4o', 'o3*'] },
    { name: 'beta', base_url: beta.baseUrl, api_key_env: 'BETA_KEY', models: ['*'] },
  ]);
  const gateway = await startTestGateway(t, {
    env: { UPSTREAMS_FILE: file, ALPHA_KEY: 'sk-alpha-secret', BETA_KEY: 'sk-beta-secret' },
  });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  for (const model of ['gpt-4o', 'o3-mini', 'gpt-4o-mini', 'llama']) {
    const answer = await client.post({ model, messages: userMessage(model), wait: true });
    t.equal(answer.status, 200, `${model} completed`);
  }
  t.same(alpha.calls.map((call) => call.body.model), ['gpt-4o', 'o3-mini'], 'exact names and prefixes of the first upstream');
  t.same(beta.calls.map((call) => call.body.model), ['gpt-4o-mini', 'llama'], 'the rest to the catch-all');
  t.ok(alpha.calls.every((call) => call.headers.authorization === 'Bearer sk-alpha-secret'));
  t.ok(beta.calls.every((call) => call.headers.authorization === 'Bearer sk-beta-secret'));
  const { rows } = await gateway.pool.query(
    'select upstream, model, deployment from gateway.lanes order by model, deployment',
  );
  t.same(rows, [
    { upstream: 'alpha', model: 'gpt-4o', deployment: 1 },
    { upstream: 'beta', model: 'gpt-4o', deployment: 2 },
    { upstream: 'beta', model: 'gpt-4o-mini', deployment: 1 },
    { upstream: 'beta', model: 'llama', deployment: 1 },
    { upstream: 'alpha', model: 'o3-mini', deployment: 1 },
    { upstream: 'beta', model: 'o3-mini', deployment: 2 },
  ], 'one lane per deployment of each model, in the file\'s order');
  const attempts = await gateway.pool.query('select upstream, count(*)::int as attempts from gateway.request_attempts group by upstream order by upstream');
  t.same(attempts.rows, [{ upstream: 'alpha', attempts: 2 }, { upstream: 'beta', attempts: 2 }], 'each attempt names its upstream');
  t.notOk(gateway.logs.some((line) => line.includes('sk-alpha-secret') || line.includes('sk-beta-secret')), 'no key in the logs');
});

t.test('a model no upstream serves is a 400 naming model, and nothing is stored', async (t) => {
  const upstream = await startFakeUpstream(t);
  const file = await upstreamsFile(t, [{ name: 'only', base_url: upstream.baseUrl, models: ['gpt-4o'] }]);
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: file } });
  const key = await gateway.createKey({ mode: 'live' });
  const answer = await clientFor(gateway.url, key).post({ model: 'claude-9', messages: userMessage() });
  t.equal(answer.status, 400);
  t.same(answer.body.error, {
    message: "Invalid 'model': no upstream serves the model 'claude-9'.",
    type: 'invalid_request_error',
    code: 'invalid_parameter',
    param: 'model',
  });
  t.equal(await countRows(gateway.db, 'requests'), 0, 'no request');
  const { rows } = await gateway.pool.query(
    'select (select count(*)::int from gateway.signature_nonces) as nonces, (select count(*)::int from gateway.queues) as queues, (select count(*)::int from gateway.lanes) as lanes',
  );
  t.same(rows[0], { nonces: 0, queues: 0, lanes: 0 }, 'no nonce, no queue, no lane');
  t.equal(upstream.calls.length, 0);
});

t.test('test-delay beyond UPSTREAM_TIMEOUT_MS is a 400 naming model; up to it is accepted', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api', env: { UPSTREAM_TIMEOUT_MS: '5000' } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'test' }));
  const refused = await client.post({ model: 'test-delay-5001', messages: userMessage() });
  t.equal(refused.status, 400);
  t.match(refused.body.error, { code: 'invalid_parameter', param: 'model', message: /at most 5000 ms/ });
  t.equal(await countRows(gateway.db, 'requests'), 0, 'nothing stored');
  const refusedHuge = await client.post({ model: 'test-delay-999999999', messages: userMessage() });
  t.equal(refusedHuge.status, 400, 'nor a delay of days');
  t.equal((await client.post({ model: 'test-delay-99999999999', messages: userMessage() })).status, 400, 'however many digits');
  t.equal((await client.post({ model: 'test-delay-5000', messages: userMessage() })).status, 202);
});

t.test('usage: stored per request, summed per day by usage_daily, counted in the metrics', async (t) => {
  const upstream = await startFakeUpstream(t, (call) => ({
    status: 200,
    json: { ...completionFor(call.body), usage: { prompt_tokens: 11, completion_tokens: 7, total_tokens: 18 } },
  }));
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl, METRICS_PORT: '0' } });
  const live = clientFor(gateway.url, await gateway.createKey({ project: 'usage', mode: 'live' }));
  const test = clientFor(gateway.url, await gateway.createKey({ project: 'usage', mode: 'test' }));
  for (let i = 0; i < 3; i++) t.equal((await live.post({ model: 'gpt-usage', messages: userMessage(), wait: true })).status, 200);
  const simulated = await test.post({ model: 'test-echo', messages: userMessage('four words of text'), wait: true });
  t.equal(simulated.status, 200);

  const { rows: requests } = await gateway.pool.query(
    `select mode, prompt_tokens, completion_tokens, total_tokens from gateway.requests order by mode, id`,
  );
  t.same(requests.filter((row) => row.mode === 'live'), Array(3).fill({ mode: 'live', prompt_tokens: 11, completion_tokens: 7, total_tokens: 18 }));
  const usage = simulated.body.usage;
  t.same(requests.find((row) => row.mode === 'test'), {
    mode: 'test',
    prompt_tokens: usage.prompt_tokens,
    completion_tokens: usage.completion_tokens,
    total_tokens: usage.total_tokens,
  }, 'the simulator\'s usage too');

  const today = new Date().toISOString().slice(0, 10);
  const { rows: daily } = await gateway.pool.query(
    `select to_char(day, 'YYYY-MM-DD') as day, project, mode, upstream, model, requests::int, prompt_tokens::int,
            completion_tokens::int, total_tokens::int
     from gateway.usage_daily order by mode`,
  );
  t.same(daily, [
    { day: today, project: 'usage', mode: 'live', upstream: 'default', model: 'gpt-usage', requests: 3, prompt_tokens: 33, completion_tokens: 21, total_tokens: 54 },
    { day: today, project: 'usage', mode: 'test', upstream: 'simulator', model: 'test-echo', requests: 1, prompt_tokens: usage.prompt_tokens, completion_tokens: usage.completion_tokens, total_tokens: usage.total_tokens },
  ]);

  // A waiter woken by the NOTIFY of its request's finish may be answered a moment before the
  // worker that recorded it counts its tokens: the counts are read once all four are in.
  const simulatorPrompt = new RegExp(`gateway_tokens_total\\{mode="test",upstream="simulator",model="simulator",kind="prompt"\\} ${usage.prompt_tokens}\\n`);
  let metrics = '';
  await until(async () => {
    metrics = (await send(gateway.metricsUrl, { path: '/metrics' })).text;
    return simulatorPrompt.test(metrics) && /gateway_tokens_total\{mode="live",upstream="default",model="\*",kind="completion"\} 21\n/.test(metrics);
  }, () => `the token counts in the metrics:\n${metrics}`);
  t.match(metrics, /gateway_tokens_total\{mode="live",upstream="default",model="\*",kind="prompt"\} 33\n/, 'prompt tokens by mode, upstream and model pattern');
  t.match(metrics, /gateway_tokens_total\{mode="live",upstream="default",model="\*",kind="completion"\} 21\n/);
  t.match(metrics, simulatorPrompt);
});

t.test('tokens_per_minute: the estimate is stored at acceptance and the lane corrected with the usage', async (t) => {
  const upstream = await startFakeUpstream(t, (call) => ({
    status: 200,
    json: { ...completionFor(call.body), usage: { prompt_tokens: 20, completion_tokens: 1000, total_tokens: 1020 } },
  }));
  const file = await upstreamsFile(t, [
    { name: 'metered', base_url: upstream.baseUrl, models: ['*'], limits: { tokens_per_minute: 600_000 } },
  ]);
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: file } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const answer = await client.post({ model: 'gpt-metered', messages: userMessage('Hello there, how are you today?'), wait: true });
  t.equal(answer.status, 200);
  const { rows } = await gateway.pool.query(
    `select requests.prompt_tokens_estimate, lanes.tokens_per_minute, lanes.token_allowance, lanes.refilled_at
     from gateway.requests join gateway.lanes on lanes.id = requests.lane_id`,
  );
  const [row] = rows;
  t.ok(row.prompt_tokens_estimate > 5 && row.prompt_tokens_estimate < 40, `a prompt estimate stored (${row.prompt_tokens_estimate})`);
  t.equal(row.tokens_per_minute, 600_000, 'the lane carries its limit');
  // A full allowance is LANE_PACING.burstSeconds of 600,000 a minute. The claim took the estimate;
  // the completion took the rest of its 1,020 (refills since are at most a few hundred).
  const full = (LANE_PACING.burstSeconds * 600_000) / 60;
  const spent = full - row.token_allowance;
  t.ok(spent > 1_020 - 300 && spent <= 1_020, `the lane was charged the usage, not the estimate (${spent.toFixed(0)} of ${full})`);
});
