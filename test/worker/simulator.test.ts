// Test mode: the built-in simulator answers by model name, and a test
// key's request never reaches the upstream.
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { attemptRows, isTerminal, requestRow, waitForRow } from '../helpers/rows.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';

t.test('simulated behaviours, and no call to the upstream', async (t) => {
  const upstream = await startFakeUpstream(t);
  const gateway = await startTestGateway(t, {
    env: { UPSTREAM_BASE_URL: upstream.baseUrl, MAX_ATTEMPTS: '4', UPSTREAM_TIMEOUT_MS: '200' },
  });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'test' }));
  const run = async (model: string) => {
    const accepted = await client.post({ model, messages: userMessage(`for ${model}`) });
    const row = await waitForRow(gateway.db, accepted.body.id, isTerminal);
    return { row, attempts: await attemptRows(gateway.db, row.id) };
  };

  const echo = await run('any-model');
  t.match(echo.row, { status: 'completed', attempts: 1, last_error_code: null });
  const result = echo.row.result as any;
  t.match(result.id, /^chatcmpl-/);
  t.equal(result.object, 'chat.completion');
  t.equal(result.model, 'any-model');
  t.equal(result.choices.length, 1);
  t.same(result.choices[0].message, { role: 'assistant', content: 'for any-model', refusal: null });
  t.equal(result.choices[0].finish_reason, 'stop');
  t.ok(result.usage.prompt_tokens > 0 && result.usage.completion_tokens > 0);
  t.equal(result.usage.total_tokens, result.usage.prompt_tokens + result.usage.completion_tokens);

  const flaky = await run('test-fail-2');
  t.match(flaky.row, { status: 'completed', attempts: 3, last_error_code: 'upstream_server_error' });
  t.same(flaky.attempts.map((attempt) => [attempt.outcome, attempt.error_code, attempt.upstream_status]), [
    ['failed', 'upstream_server_error', 500],
    ['failed', 'upstream_server_error', 500],
    ['succeeded', null, 200],
  ]);

  for (const [status, code, attempts] of [
    [400, 'upstream_bad_request', 1],
    [422, 'upstream_bad_request', 1],
    [401, 'upstream_auth_error', 4],
    [429, 'upstream_rate_limited', 4],
    [503, 'upstream_server_error', 4],
  ] as const) {
    const { row } = await run(`test-error-${status}`);
    t.match(row, { status: 'failed', attempts, last_error_code: code }, `test-error-${status}`);
  }

  const slow = await run('test-delay-100');
  t.match(slow.row, { status: 'completed', attempts: 1 });
  t.ok(slow.attempts[0]!.duration_ms! >= 100, 'test-delay-100 took at least 100 ms');

  const tooSlow = await client.post({ model: 'test-delay-1000', messages: userMessage() });
  t.match(tooSlow, { status: 400, body: { error: { code: 'invalid_parameter', param: 'model' } } }, 'a delay past UPSTREAM_TIMEOUT_MS is refused');

  t.equal(upstream.calls.length, 0, 'nothing reached the upstream');
});

t.test('a simulated 429 pauses no one: the test lane, every project\'s, stays open to the others', async (t) => {
  // Backoffs of up to an hour (full jitter: under the suite's WAIT_TIMEOUT_MS, 3 s, one time in
  // a thousand): a pause of the lane for the 429's backoff would hold the other project's request
  // past its client's wait, to be answered 202.
  const gateway = await startTestGateway(t, { env: { MAX_ATTEMPTS: '3', RETRY_BASE_MS: '3600000', RETRY_MAX_MS: '3600000' } });
  const noisy = clientFor(gateway.url, await gateway.createKey({ mode: 'test', project: 'noisy' }));
  const quiet = clientFor(gateway.url, await gateway.createKey({ mode: 'test', project: 'quiet' }));
  const refused = await noisy.post({ model: 'test-error-429', messages: userMessage() });
  await waitForRow(gateway.db, refused.body.id, (row) => row.attempts >= 1 && row.status === 'retrying');
  const { rows } = await gateway.pool.query(`select paused_until from gateway.lanes where mode = 'test'`);
  t.same(rows, [{ paused_until: null }], 'the simulator\'s lane is not paused');
  const answer = await quiet.post({ model: 'test-echo', messages: userMessage(), wait: true });
  t.equal(answer.status, 200, 'another project\'s request completes while its client waits, not after the 429\'s backoff');
  t.match(await requestRow(gateway.db, refused.body.id), { status: 'retrying', last_error_code: 'upstream_rate_limited' }, 'the refused request waits out its own backoff');
});
