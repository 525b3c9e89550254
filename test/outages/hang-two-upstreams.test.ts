// Two upstreams' outages at once do not stall the other upstreams' lanes: upstreams x and y hang
// every call (no answer; the gateway's UPSTREAM_TIMEOUT_MS of 60 s ends each), each with a
// backlog of its model above the worker's MAX_IN_FLIGHT of 20, then requests arrive for a model
// that only healthy upstreams serve (answering in 200 ms): z alone, or z and w (two deployments,
// z preferred). x's and y's calls leave the healthy upstreams their reserves of the capacity, and
// every one of the healthy model's requests completes within 20 s, while none of x's and y's
// calls has timed out yet: those requests found room beside the hung calls, and did not wait for
// their timeouts to make it.
import { setTimeout as sleep } from 'node:timers/promises';
import t, { type Test } from 'tap';
import { tally } from '../faults/support/client.ts';
import { queueSummary, waitUntilTerminal } from '../faults/support/rows.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { upstreamReserve } from '../../src/worker/dispatcher.ts';
import { outageReply, post, requestsWithAttempts, startOutageGateway } from './support.ts';

const MAX_IN_FLIGHT = 20;
const UPSTREAM_TIMEOUT_MS = 60_000;
const BACKLOG = 30;
const HEALTHY_REQUESTS = 10;
/** How long the healthy model's requests are given: one 200 ms call at a time (a reserve) needs 2 s, a timeout of x's or y's 60. */
const HEALTHY_WAIT_MS = 20_000;

/** x and y hang with their backlogs; then model-h, served by the `healthy` upstreams in this order, gets its requests. */
async function besideTwoHanging(t: Test, healthy: string[]): Promise<void> {
  const x = await startFakeUpstream(t, outageReply({ kind: 'hang' }));
  const y = await startFakeUpstream(t, outageReply({ kind: 'hang' }));
  const fine = await Promise.all(healthy.map(() => startFakeUpstream(t, outageReply({ kind: 'healthy' }, 200))));
  const gateway = await startOutageGateway(
    t,
    [
      { name: 'x', base_url: x.baseUrl, models: ['model-x'] },
      { name: 'y', base_url: y.baseUrl, models: ['model-y'] },
      ...healthy.map((name, i) => ({ name, base_url: fine[i]!.baseUrl, models: ['model-h'] })),
    ],
    { MAX_IN_FLIGHT: String(MAX_IN_FLIGHT), UPSTREAM_TIMEOUT_MS: String(UPSTREAM_TIMEOUT_MS) },
  );
  const key = await gateway.createKey({ project: 'outages-hang-two-upstreams', mode: 'live' });

  const hungAccepted = await Promise.all(
    Array.from({ length: 2 * BACKLOG }, (_, i) => post(gateway.url, key, `hung request ${i}`, i % 2 === 0 ? 'model-x' : 'model-y')),
  );
  t.equal(tally(hungAccepted.map((answer) => answer.status)), `202: ${2 * BACKLOG}`, `x's and y's ${BACKLOG} requests each acknowledged`);
  // x's and y's calls start, as many as the worker gives them, and hang.
  let seen = -1;
  while (x.calls.length + y.calls.length !== seen) {
    seen = x.calls.length + y.calls.length;
    await sleep(1_000);
  }
  const hung = [...x.calls, ...y.calls];
  t.ok(hung.length > 0 && hung.every((call) => call.endedAt === undefined), `x has ${x.calls.length} calls hanging and y ${y.calls.length}, none answered`);
  const reserve = upstreamReserve(MAX_IN_FLIGHT, 2 + healthy.length);
  t.equal(
    hung.length,
    MAX_IN_FLIGHT - healthy.length * reserve,
    `x's and y's calls take all of MAX_IN_FLIGHT but the reserves of ${healthy.join(' and ')} (${reserve} each)`,
  );

  const accepted = await Promise.all(Array.from({ length: HEALTHY_REQUESTS }, (_, i) => post(gateway.url, key, `healthy request ${i}`, 'model-h')));
  t.equal(tally(accepted.map((answer) => answer.status)), `202: ${HEALTHY_REQUESTS}`, `model-h's ${HEALTHY_REQUESTS} requests acknowledged`);
  const ids = accepted.map((answer) => answer.body?.id as string);
  const ended = await waitUntilTerminal(gateway.pool, ids, HEALTHY_WAIT_MS);
  t.ok(ended.done, `model-h's requests all ended (left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);
  if (!ended.done) t.comment(await queueSummary(gateway.pool));

  // Read after model-h's requests: none of x's and y's attempts has ended (the first would end with its timeout).
  const hungRequests = await requestsWithAttempts(gateway.pool, hungAccepted.map((answer) => answer.body?.id as string));
  const hungAttempts = hungRequests.flatMap((request) => request.attempt_rows);
  t.equal(hungAttempts.length, hung.length, 'x\'s and y\'s attempts: one for each call hanging');
  t.equal(
    tally(hungAttempts.map((attempt) => (attempt.finished_at === null ? 'unfinished' : `finished ${attempt.error_code}`))),
    `unfinished: ${hung.length}`,
    'none of x\'s and y\'s attempts has ended: model-h\'s requests did not wait for their timeouts',
  );
  const requests = await requestsWithAttempts(gateway.pool, ids);
  t.equal(tally(requests.map((request) => request.status)), `completed: ${HEALTHY_REQUESTS}`, `model-h's ${HEALTHY_REQUESTS} requests completed`);
  t.comment(`x's calls: ${x.calls.length}; y's calls: ${y.calls.length}; ${healthy.map((name, i) => `${name}'s calls: ${fine[i]!.calls.length}`).join('; ')}`);
}

t.test('upstreams x and y hang with backlogs above MAX_IN_FLIGHT: z\'s requests all complete while x\'s and y\'s calls still hang', (t) =>
  besideTwoHanging(t, ['z']),
);

t.test('the same with the healthy model deployed on z and w: its queue finds room in one of their reserves', (t) => besideTwoHanging(t, ['z', 'w']));
