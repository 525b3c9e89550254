// The official `openai` SDK talks to the gateway through createSigningFetch.
import OpenAI from 'openai';
import t from 'tap';
import { createSigningFetch } from '../../src/client/index.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { signaturesOf, startFlakyProxy } from './proxy.ts';

async function setUp(t: Parameters<typeof startTestGateway>[0]) {
  const gateway = await startTestGateway(t, { env: { SIGNATURES: 'required' } });
  const key = await gateway.createKey({ mode: 'test' });
  return { gateway, key };
}

t.test('the openai SDK with the signing fetch creates a completion with wait: true', async (t) => {
  const { gateway, key } = await setUp(t);
  const openai = new OpenAI({
    apiKey: key.api_key,
    baseURL: `${gateway.url}/v1`,
    fetch: createSigningFetch({ signingSecret: key.signing_secret }),
  });

  const completion = await openai.chat.completions.create({
    model: 'test-echo',
    messages: [{ role: 'user', content: 'from the SDK' }],
    // @ts-expect-error wait is the gateway's own body parameter
    wait: true,
  });

  t.equal(completion.object, 'chat.completion');
  t.match(completion.id, /^chatcmpl-/);
  t.equal(completion.choices[0]?.message.content, 'from the SDK');
  const { rows } = await gateway.pool.query('select status, result from gateway.requests');
  t.equal(rows.length, 1);
  t.equal(rows[0].status, 'completed');
  t.same(rows[0].result, completion);
});

t.test("the SDK's own retries are signed afresh and accepted", async (t) => {
  const { gateway, key } = await setUp(t);
  const proxy = await startFlakyProxy(t, gateway.url, ['unavailable']);
  const openai = new OpenAI({
    apiKey: key.api_key,
    baseURL: `${proxy.url}/v1`,
    fetch: createSigningFetch({ signingSecret: key.signing_secret, baseURL: `${proxy.url}/v1` }),
    maxRetries: 2,
  });

  const completion = await openai.chat.completions.create({
    model: 'test-echo',
    messages: [{ role: 'user', content: 'second try' }],
    // @ts-expect-error the gateway's own body parameters
    wait: true,
    idempotency_key: 'sdk-retry-1',
  });

  t.equal(completion.object, 'chat.completion');
  t.equal(proxy.calls.length, 2, 'the 503 was retried by the SDK');
  t.equal(proxy.calls[0]!.body, proxy.calls[1]!.body);
  const signatures = signaturesOf(proxy.calls, key.signing_secret);
  t.ok(signatures.every((signature) => signature.valid), 'both attempts validly signed');
  t.not(signatures[0]!.nonce, signatures[1]!.nonce, 'each attempt with its own nonce');
  t.equal(proxy.calls[1]!.answer?.status, 200, 'the gateway accepted the retry');
});

t.test('the SDK with a wrong signing secret is refused with invalid_signature', async (t) => {
  const { gateway, key } = await setUp(t);
  const openai = new OpenAI({
    apiKey: key.api_key,
    baseURL: `${gateway.url}/v1`,
    fetch: createSigningFetch({ signingSecret: `svc_sig_${'z'.repeat(40)}` }),
  });
  const error = await openai.chat.completions
    .create({ model: 'test-echo', messages: [{ role: 'user', content: 'x' }] })
    .catch((caught: unknown) => caught);
  t.type(error, OpenAI.AuthenticationError);
  t.equal((error as InstanceType<typeof OpenAI.AuthenticationError>).status, 401);
  t.equal((error as InstanceType<typeof OpenAI.AuthenticationError>).code, 'invalid_signature');
  const { rows } = await gateway.pool.query('select count(*)::int as count from gateway.requests');
  t.equal(rows[0].count, 0);
});
