// A claim leaves a large body out (lanes/repository.ts claimQueue), so that a request of
// megabytes holds up neither the claim's other requests nor its queue: the worker reads it in a
// statement of its own before calling (worker/attempts.ts). Each request stores its body's size.
import { sql } from 'kysely';
import t from 'tap';
import { LARGE_BODY_BYTES } from '../../src/db/batcher.ts';
import type { Db } from '../../src/db/pool.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { claimQueueOf, queueOf, waitForRow } from '../helpers/rows.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';

const LARGE_CONTENT = 'x'.repeat(LARGE_BODY_BYTES + 1000);

/** Each request's stored body as text, and its body_bytes. */
async function stored(db: Db, ids: string[]) {
  const { rows } = await sql<{ id: string; body: string; body_bytes: number | null }>`
    select id, body::text as body, body_bytes from gateway.requests where id = any(${ids}::text[])
  `.execute(db);
  return new Map(rows.map((row) => [row.id, row]));
}

t.test('a claim starts a large request without its body, and every other with its own; each stores its size', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const client = clientFor(api.url, await api.createKey({ mode: 'live' }));
  const small = (await client.post({ model: 'gpt-test', messages: userMessage('small') })).body.id as string;
  const large = (await client.post({ model: 'gpt-test', messages: userMessage(LARGE_CONTENT) })).body.id as string;
  const rows = await stored(api.db, [small, large]);
  for (const id of [small, large]) {
    t.equal(rows.get(id)!.body_bytes, Buffer.byteLength(rows.get(id)!.body), `${id === small ? 'the small' : 'the large'} one's body_bytes is its stored body's size`);
  }

  const claim = await claimQueueOf(api.db, small, 10, 'worker-claiming');
  const started = new Map(claim.started.map((attempt) => [attempt.id, attempt]));
  t.same([...started.keys()].sort(), [small, large].sort(), 'both are started');
  t.equal(started.get(small)!.body, rows.get(small)!.body, 'the small one with its body');
  t.equal(started.get(large)!.body, undefined, 'the large one without');
});

t.test("the previous version's claim (nine arguments), which its workers call until they are replaced, returns every body", async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const client = clientFor(api.url, await api.createKey({ mode: 'live' }));
  const small = (await client.post({ model: 'gpt-test', messages: userMessage('small') })).body.id as string;
  const large = (await client.post({ model: 'gpt-test', messages: userMessage(LARGE_CONTENT) })).body.id as string;
  // The lane, as the current claim would use it.
  await claimQueueOf(api.db, small, 0, 'worker-claiming');
  const queueId = await queueOf(api.db, small);
  const { rows } = await sql<{ request_id: string | null; body: string | null }>`
    select request_id, body
    from gateway.claim_queue(${queueId}::bigint, 10, 'worker-of-before', array(select id from gateway.lanes where queue_id = ${queueId}::bigint),
                             array[null]::int[], array[null]::int[], array[null]::int[], 0.95::float8, 0.9::float8)
    where request_id is not null
  `.execute(api.db);
  const bodies = await stored(api.db, [small, large]);
  t.same(
    new Map(rows.map((row) => [row.request_id, row.body])),
    new Map([small, large].map((id) => [id, bodies.get(id)!.body])),
    'both are started, each with its body',
  );
});

t.test('a worker reads the large bodies its claim left out and sends them whole: each request completes in one attempt', async (t) => {
  const upstream = await startFakeUpstream(t);
  const env = { UPSTREAM_BASE_URL: upstream.baseUrl };
  const gateway = await startTestGateway(t, { role: 'all', env });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const ids = await Promise.all(
    [LARGE_CONTENT, 'small', `${LARGE_CONTENT}y`].map(async (content) => (await client.post({ model: 'gpt-test', messages: userMessage(content) })).body.id as string),
  );
  for (const id of ids) {
    t.match(await waitForRow(gateway.db, id, (row) => row.status === 'completed'), { status: 'completed', attempts: 1 }, 'completed, in one attempt');
  }
  t.same(
    upstream.calls.map((call) => call.content).sort(),
    [LARGE_CONTENT, `${LARGE_CONTENT}y`, 'small'].sort(),
    'the upstream got each message once, whole',
  );
});
