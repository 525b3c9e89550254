// A lane's tokens_per_minute against large prompts: a prompt larger than a minute of every
// deployment's tokens is refused at intake, and an attempt that ends without a completion (the
// provider refused the prompt) gives its estimate back, so the lane does not stay shut for the
// other requests, whether accepted after it, waiting already, or being claimed as it is given back,
// nor does its project's place in the lane's fair share keep it.
import t, { type Test } from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor } from '../helpers/http.ts';
import { countRows, isTerminal, waitForRow, waitingOnLock } from '../helpers/rows.ts';
import { completionFor, startFakeUpstream } from '../helpers/upstream.ts';
import { upstreamsFile } from '../helpers/upstreams-file.ts';
import { until } from '../helpers/wait.ts';

/** A prompt of about `tokens` tokens. */
const prompt = (tokens: number) => [{ role: 'user', content: 'word '.repeat(tokens) }];

/**
 * A provider that answers a small prompt at once and refuses a large one (a body over 5,000
 * characters) with a 400 and no usage, once `refusing` resolves when it is given; and an
 * upstreams file serving gpt-limited from it at 3,000 tokens a minute, which a 2,000-token
 * prompt overdraws by some 40 s worth.
 */
async function refusingLargePrompts(t: Test, refusing?: Promise<void>) {
  const upstream = await startFakeUpstream(t, async (call) => {
    if (JSON.stringify(call.body).length <= 5_000) return { status: 200, json: completionFor(call.body) };
    await refusing;
    return { status: 400, json: { error: { message: 'too long' } } };
  });
  const file = await upstreamsFile(t, [
    { name: 'limited', base_url: upstream.baseUrl, models: ['gpt-limited'], limits: { tokens_per_minute: 3000 } },
  ]);
  return { upstream, file };
}

/** A promise, and the function that resolves it. */
function gate(): { opened: Promise<void>; open: () => void } {
  let open!: () => void;
  const opened = new Promise<void>((resolve) => (open = resolve));
  return { opened, open };
}

t.test('a prompt larger than a minute of every deployment\'s tokens is a 400 naming messages, and nothing is stored', async (t) => {
  const upstream = await startFakeUpstream(t);
  const file = await upstreamsFile(t, [
    { name: 'small', base_url: upstream.baseUrl, models: ['gpt-small'], limits: { tokens_per_minute: 1000 } },
    { name: 'small-too', base_url: upstream.baseUrl, models: ['gpt-small', 'gpt-mixed'], limits: { tokens_per_minute: 1500 } },
    { name: 'unlimited', base_url: upstream.baseUrl, models: ['gpt-mixed'] },
  ]);
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: file } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));

  const refused = await client.post({ model: 'gpt-small', messages: prompt(2_000) });
  t.equal(refused.status, 400);
  t.match(refused.body.error, {
    type: 'invalid_request_error',
    code: 'invalid_parameter',
    param: 'messages',
    message: /estimated at \d+ tokens, more than the 1500 tokens per minute that the upstreams serving 'gpt-small' allow/,
  });
  t.equal(await countRows(gateway.db, 'requests'), 0, 'no request stored');
  const { rows } = await gateway.pool.query('select count(*)::int as count from gateway.queues');
  t.equal(rows[0].count, 0, 'nor its queue');

  const fits = await client.post({ model: 'gpt-small', messages: prompt(500), wait: true });
  t.equal(fits.status, 200, 'a prompt that fits is served');
  const mixed = await client.post({ model: 'gpt-mixed', messages: prompt(2_000), wait: true });
  t.equal(mixed.status, 200, 'a large prompt is served when a deployment has no token limit');
});

t.test('a prompt the provider refuses (no usage) gives its estimate back: the next request starts at once', async (t) => {
  const { file } = await refusingLargePrompts(t);
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: file } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));

  const large = await client.post({ model: 'gpt-limited', messages: prompt(2_000) });
  t.equal(large.status, 202);
  t.match(await waitForRow(gateway.db, large.body.id, isTerminal), { status: 'failed', last_error_code: 'upstream_bad_request' });
  const { rows } = await gateway.pool.query(`select token_allowance from gateway.lanes where upstream = 'limited'`);
  t.ok(rows[0].token_allowance > -100, `the lane's allowance is back near full (${Math.round(rows[0].token_allowance)} tokens), not some 2,000 below`);

  const small = await client.post({ model: 'gpt-limited', messages: prompt(10), wait: true });
  // 200, not 202: answered within the suite's WAIT_TIMEOUT_MS (3 s), not after the lane paid back
  // the refused prompt (some 40 s).
  t.equal(small.status, 200, 'the next request completes while its client waits');
});

t.test('requests waiting on a lane overdrawn by a prompt the provider then refuses start once it gives its estimate back, not when the overdraw would have been paid', async (t) => {
  const { opened: refused, open: refuse } = gate();
  const { upstream, file } = await refusingLargePrompts(t, refused);
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: file, UPSTREAM_TIMEOUT_MS: '60000' } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));

  const large = await client.post({ model: 'gpt-limited', messages: prompt(2_000) });
  t.equal(large.status, 202);
  await until(() => upstream.calls.length > 0, 'the large prompt to reach the provider', 10_000);
  const small = await client.post({ model: 'gpt-limited', messages: prompt(10) });
  t.equal(small.status, 202);
  // The small request's claim found the lane overdrawn: its queue is dispatched when the lane has paid it back.
  const wakeAt = async () => (await gateway.pool.query(`select wake_at from gateway.queues`)).rows[0].wake_at as Date | null;
  await until(async () => (await wakeAt()) !== null, 'the small request\'s claim to find the lane overdrawn', 10_000);
  const paidBackAt = (await wakeAt())!;
  // Its process's fallback dispatch (due 2 s after it was accepted) has run too, and found no room either.
  const fallbacks = async () =>
    (await gateway.pool.query(`select count(*)::int as count from graphile_worker.jobs where key like 'dispatch_fallback:%'`)).rows[0].count as number;
  await until(async () => (await fallbacks()) === 0, 'the fallback dispatch to have run', 10_000);

  refuse();
  t.match(await waitForRow(gateway.db, large.body.id, isTerminal), { status: 'failed', last_error_code: 'upstream_bad_request' });
  const done = await waitForRow(gateway.db, small.body.id, isTerminal, 60_000);
  t.equal(done.status, 'completed');
  t.ok(done.finished_at! < paidBackAt, `the small request completed (${done.finished_at!.toISOString()}) before the overdraw would have been paid back (${paidBackAt.toISOString()})`);
});

t.test('a refund recorded while a claim that found the lane overdrawn commits still dispatches the request that claim left waiting', async (t) => {
  const { opened: refused, open: refuse } = gate();
  const { upstream, file } = await refusingLargePrompts(t, refused);
  // The API and the worker apart: an accepted request is dispatched by its job, due at once, and
  // by nothing else (no fallback of the accepting process). WORKER_DEAD_AFTER_MS keeps the
  // rescue of stranded queues out of the way.
  const env = { UPSTREAMS_FILE: file, UPSTREAM_TIMEOUT_MS: '60000', WORKER_DEAD_AFTER_MS: '60000' };
  const api = await startTestGateway(t, { role: 'api', env });
  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env });
  const client = clientFor(api.url, await api.createKey({ mode: 'live' }));

  const large = await client.post({ model: 'gpt-limited', messages: prompt(2_000) });
  t.equal(large.status, 202);
  await until(() => upstream.calls.length > 0, 'the large prompt to reach the provider', 10_000);
  // When the lane would have paid back the large prompt's overdraw, at the pace the claim keeps.
  const { rows: lanes } = await api.pool.query<{ paid_back_at: Date }>(
    `select refilled_at + (0.001 - token_allowance) / (0.95 * tokens_per_minute / 60.0) * interval '1 second' as paid_back_at
     from gateway.lanes where upstream = 'limited'`,
  );
  const paidBackAt = lanes[0]!.paid_back_at;

  // The queue's row, locked here (as an update does: its requests' inserts still check their
  // key): the small request's claim, which finds the lane overdrawn,
  // waits for it to write when the queue is to be dispatched next, holding the lane. The large
  // prompt's refusal is recorded meanwhile: its statement waits for the lane, and reads the queue
  // as it was before that claim.
  const locker = await api.pool.connect();
  t.teardown(() => locker.release());
  await locker.query('begin');
  await locker.query('select from gateway.queues for no key update');
  const small = await client.post({ model: 'gpt-limited', messages: prompt(10) });
  t.equal(small.status, 202);
  await until(async () => (await waitingOnLock(api.pool, 'gateway-worker')) === 1, 'the small request\'s claim to wait for the queue');
  refuse();
  await until(async () => (await waitingOnLock(api.pool, 'gateway-worker')) === 2, 'the refusal\'s recording to wait for the lane');
  await locker.query('commit');

  t.match(await waitForRow(api.db, large.body.id, isTerminal), { status: 'failed', last_error_code: 'upstream_bad_request' });
  const done = await waitForRow(api.db, small.body.id, isTerminal, 60_000);
  t.equal(done.status, 'completed');
  t.ok(done.finished_at! < paidBackAt, `the small request completed (${done.finished_at!.toISOString()}) before the overdraw would have been paid back (${paidBackAt.toISOString()})`);
});

t.test('a project whose prompt the provider refused is placed in the lane\'s fair share as having used none of its tokens', async (t) => {
  const { opened: busy, open: releaseBusy } = gate();
  // P's 2,000-token prompt is refused at once; Q's 1,000-token one is held, its call in flight,
  // until the small requests have started; the small ones are answered at once.
  const upstream = await startFakeUpstream(t, async (call) => {
    const length = JSON.stringify(call.body).length;
    if (length > 7_500) return { status: 400, json: { error: { message: 'too long' } } };
    if (length > 2_500) await busy;
    return { status: 200, json: completionFor(call.body) };
  });
  t.teardown(() => releaseBusy());
  // 12,000 tokens a minute (190 a second, paced): Q's prompt overdraws the lane by some 5 s worth,
  // and the small requests, of some 40 tokens, then start about one a claim.
  const file = await upstreamsFile(t, [
    { name: 'limited', base_url: upstream.baseUrl, models: ['gpt-limited'], limits: { tokens_per_minute: 12_000 } },
  ]);
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: file, UPSTREAM_TIMEOUT_MS: '60000' } });
  const p = clientFor(gateway.url, await gateway.createKey({ mode: 'live', project: 'p' }));
  const q = clientFor(gateway.url, await gateway.createKey({ mode: 'live', project: 'q' }));

  const refused = await p.post({ model: 'gpt-limited', messages: prompt(2_000) });
  t.equal(refused.status, 202);
  t.match(await waitForRow(gateway.db, refused.body.id, isTerminal), { status: 'failed', last_error_code: 'upstream_bad_request' });
  const held = await q.post({ model: 'gpt-limited', messages: prompt(1_000) });
  t.equal(held.status, 202);
  await until(() => upstream.calls.length === 2, 'Q\'s prompt to reach the provider', 10_000);

  // Both projects' small requests wait while the lane pays back Q's prompt.
  const small: Record<string, string> = {};
  for (let i = 0; i < 5; i++) {
    for (const [project, client] of [['p', p], ['q', q]] as const) {
      const posted = await client.post({ model: 'gpt-limited', messages: prompt(40) });
      t.equal(posted.status, 202);
      small[posted.body.id] = project;
    }
  }
  for (const id of Object.keys(small)) t.equal((await waitForRow(gateway.db, id, isTerminal, 30_000)).status, 'completed');
  releaseBusy();

  // The order the lane started them in, as recorded: P used none of the lane's tokens, Q's call
  // is using 1,000 of them, so P's requests go first (an idle project starts at the clock).
  const { rows } = await gateway.pool.query<{ request_id: string; started_at: Date }>(
    `select request_id, started_at from gateway.request_attempts where request_id = any($1) order by started_at, request_id`,
    [Object.keys(small)],
  );
  const order = rows.map((row) => small[row.request_id]).join('');
  const startedAt = (project: string) => rows.filter((row) => small[row.request_id] === project).map((row) => row.started_at.getTime());
  t.ok(Math.max(...startedAt('p')) <= Math.min(...startedAt('q')),
    `each of P's small requests started no later than Q's first (started in the order ${order}), not behind the 2,000 tokens P was refused`);
});
