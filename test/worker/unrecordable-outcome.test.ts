// A completion the database refuses to record never leaves its attempt running: the sweep
// recovers only the attempts of dead workers, and this one's worker is alive, so the request
// would stay processing until its deadline. An answer the database refuses for good is recorded
// as an invalid answer, with no result; usage that does not fit its columns is not stored; a
// recording that lost a deadlock or a serialization conflict is made again. The requests here
// are alone on their lane, with MAX_ATTEMPTS 1: a first failure is charged and ends them.
import t, { type Test } from 'tap';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { parseMetrics } from '../helpers/metrics.ts';
import { attemptRows, isTerminal, waitForRow } from '../helpers/rows.ts';
import { completionFor, startFakeUpstream, type Reply } from '../helpers/upstream.ts';

async function runAgainst(t: Test, reply: () => Reply, prepare: (gateway: TestGateway) => Promise<void> = async () => {}) {
  const upstream = await startFakeUpstream(t, reply);
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl, MAX_ATTEMPTS: '1', METRICS_PORT: '0' } });
  await prepare(gateway);
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const accepted = await client.post({ model: 'gpt-test', messages: userMessage() });
  const row = await waitForRow(gateway.db, accepted.body.id as string, isTerminal);
  const { rows } = await gateway.pool.query(
    'select result::text as result, prompt_tokens, completion_tokens, total_tokens from gateway.requests where id = $1',
    [row.id],
  );
  return { gateway, upstream, row, stored: rows[0], attempts: await attemptRows(gateway.db, row.id) };
}

t.test("a 2xx answer nested deeper than Postgres's JSON parser goes: failed as upstream_invalid_response with no result, not left processing", async (t) => {
  // 100,000 levels: past the stack of any max_stack_depth (2 MB, the default, ends near 15,000).
  const depth = 100_000;
  const text = `{"object":"chat.completion","id":"chatcmpl-1","choices":[],"x":${'['.repeat(depth)}${']'.repeat(depth)}}`;
  const { row, stored, attempts, upstream, gateway } = await runAgainst(t, () => ({ status: 200, text }));
  t.match(row, { status: 'failed', attempts: 1, charged_attempts: 1, last_error_code: 'upstream_invalid_response' });
  t.equal(stored.result, null, 'no result stored');
  t.equal(upstream.calls.length, 1);
  t.same(
    attempts.map((attempt) => [attempt.outcome, attempt.error_code, attempt.error_detail, attempt.upstream_status]),
    [['failed', 'upstream_invalid_response', "the provider's answer could not be stored", 200]],
  );
  t.ok(gateway.logs.some((line) => line.includes("could not store the provider's answer")), 'the refusal is logged');
  const samples = parseMetrics(await (await fetch(`${gateway.metricsUrl}/metrics`)).text());
  t.same(
    [...samples].filter(([name]) => name.startsWith('gateway_attempts_total{')),
    [['gateway_attempts_total{mode="live",outcome="failed",code="upstream_invalid_response"}', 1]],
    'gateway_attempts_total counts the attempt as it was recorded: failed, not succeeded',
  );
});

t.test('usage whose counts overflow their integer columns: completed, the counts that fit kept and the others null', async (t) => {
  const completion = (usage: Record<string, number>) => () => ({ status: 200, json: { ...completionFor({}), usage } });
  t.test('prompt and completion tokens fit, their sum does not, and total_tokens is missing', async (t) => {
    const { row, stored } = await runAgainst(t, completion({ prompt_tokens: 2_000_000_000, completion_tokens: 2_000_000_000 }));
    t.equal(row.status, 'completed');
    t.match(stored, { prompt_tokens: 2_000_000_000, completion_tokens: 2_000_000_000, total_tokens: null });
  });
  t.test('counts past 2^31 - 1', async (t) => {
    const { row, stored } = await runAgainst(t, completion({ prompt_tokens: 2_147_483_648, completion_tokens: 1, total_tokens: 4_000_000_000 }));
    t.equal(row.status, 'completed');
    t.match(stored, { prompt_tokens: null, completion_tokens: 1, total_tokens: null });
  });
});

for (const [name, errcode] of [
  ["a deadlock's victim", 'deadlock_detected'],
  ['a serialization failure', 'serialization_failure'],
] as const) {
  t.test(`a completion's recording that fails once as ${name} is made again: completed, the upstream called once`, async (t) => {
    const { row, stored, attempts, upstream, gateway } = await runAgainst(t, () => ({ status: 200, json: completionFor({}) }), async (gateway) => {
      await gateway.pool.query(`
        create sequence public.refusals;
        create function public.refuse_once() returns trigger language plpgsql as $$
        begin
          if nextval('public.refusals') = 1 then raise exception 'simulated conflict' using errcode = '${errcode}'; end if;
          return new;
        end $$;
        create trigger refuse_once before update on gateway.requests
          for each row when (new.status = 'completed') execute function public.refuse_once();`);
    });
    t.match(row, { status: 'completed', attempts: 1, last_error_code: null });
    t.ok(stored.result, 'the result stored');
    t.equal(upstream.calls.length, 1);
    t.same(attempts.map((attempt) => attempt.outcome), ['succeeded']);
    t.ok(gateway.logs.some((line) => line.includes('lost a conflict with another transaction')), 'the conflict is logged');
  });
}
