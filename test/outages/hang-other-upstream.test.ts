// One upstream's outage does not stall another's lanes: upstream x hangs every call (no answer;
// the gateway's UPSTREAM_TIMEOUT_MS of 15 s ends each) with a backlog of its model above the
// worker's MAX_IN_FLIGHT of 20, then requests arrive for a model that only upstream y serves, a
// healthy one answering in 200 ms. Every one of y's requests completes before the first of x's
// calls times out: they found room in the worker beside x's hung calls, and did not wait for
// x's timeouts to make it.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { tally } from '../faults/support/client.ts';
import { queueSummary, waitUntilTerminal } from '../faults/support/rows.ts';
import { startFakeUpstream } from '../helpers/upstream.ts';
import { waitFor } from '../helpers/wait.ts';
import { outageReply, post, requestsWithAttempts, seconds, startOutageGateway } from './support.ts';

const MAX_IN_FLIGHT = 20;
const UPSTREAM_TIMEOUT_MS = 15_000;
const X_BACKLOG = 40;
const Y_REQUESTS = 20;

t.test('upstream x hangs with a backlog above MAX_IN_FLIGHT: y\'s requests all complete before the first of x\'s calls times out', async (t) => {
  const x = await startFakeUpstream(t, outageReply({ kind: 'hang' }));
  const y = await startFakeUpstream(t, outageReply({ kind: 'healthy' }, 200));
  const gateway = await startOutageGateway(
    t,
    [
      { name: 'x', base_url: x.baseUrl, models: ['model-x'] },
      { name: 'y', base_url: y.baseUrl, models: ['model-y'] },
    ],
    { MAX_IN_FLIGHT: String(MAX_IN_FLIGHT), UPSTREAM_TIMEOUT_MS: String(UPSTREAM_TIMEOUT_MS) },
  );
  const key = await gateway.createKey({ project: 'outages-hang-other-upstream', mode: 'live' });

  const xAccepted = await Promise.all(Array.from({ length: X_BACKLOG }, (_, i) => post(gateway.url, key, `x request ${i}`, 'model-x')));
  t.equal(tally(xAccepted.map((answer) => answer.status)), `202: ${X_BACKLOG}`, `x's ${X_BACKLOG} requests acknowledged`);
  // x's calls start, as many as the worker gives them, and hang.
  let seen = -1;
  while (x.calls.length !== seen) {
    seen = x.calls.length;
    await sleep(1_000);
  }
  t.ok(x.calls.length > 0 && x.calls.every((call) => call.endedAt === undefined), `x has ${x.calls.length} calls hanging, none answered`);

  const yAccepted = await Promise.all(Array.from({ length: Y_REQUESTS }, (_, i) => post(gateway.url, key, `y request ${i}`, 'model-y')));
  t.equal(tally(yAccepted.map((answer) => answer.status)), `202: ${Y_REQUESTS}`, `y's ${Y_REQUESTS} requests acknowledged`);
  const yIds = yAccepted.map((answer) => answer.body?.id as string);
  const ended = await waitUntilTerminal(gateway.pool, yIds, UPSTREAM_TIMEOUT_MS + 20_000);
  t.ok(ended.done, `y's requests all ended (left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);
  if (!ended.done) t.comment(await queueSummary(gateway.pool));

  // Until the first of x's attempts has ended (its timeout), to compare with.
  const xIds = xAccepted.map((answer) => answer.body?.id as string);
  let xRequests = await requestsWithAttempts(gateway.pool, xIds);
  const xEnded = () => xRequests.flatMap((request) => request.attempt_rows.filter((attempt) => attempt.finished_at !== null));
  await waitFor(async () => {
    xRequests = await requestsWithAttempts(gateway.pool, xIds);
    return xEnded().length > 0;
  }, UPSTREAM_TIMEOUT_MS + 20_000, 500);
  const firstXEnd = Math.min(...xEnded().map((attempt) => attempt.finished_at!.getTime()));
  t.same(
    tally(xEnded().filter((attempt) => attempt.finished_at!.getTime() === firstXEnd).map((attempt) => String(attempt.error_code))),
    `upstream_timeout: ${xEnded().filter((attempt) => attempt.finished_at!.getTime() === firstXEnd).length}`,
    'the first of x\'s attempts to end ended with upstream_timeout',
  );

  const yRequests = await requestsWithAttempts(gateway.pool, yIds);
  t.equal(tally(yRequests.map((request) => request.status)), `completed: ${Y_REQUESTS}`, `y's ${Y_REQUESTS} requests completed`);
  const lastYEnd = Math.max(...yRequests.map((request) => request.finished_at?.getTime() ?? Infinity));
  const firstYAccepted = Math.min(...yRequests.map((request) => request.created_at.getTime()));
  t.ok(
    lastYEnd < firstXEnd,
    `every one of y's requests completed before the first of x's calls timed out (the last ${seconds(lastYEnd - firstYAccepted)} after y's first was accepted; x's first timeout ${seconds(firstXEnd - firstYAccepted)} after it)`,
  );
  t.comment(`x's calls: ${x.calls.length} (${x.calls.filter((call) => call.arrivedAt < firstXEnd).length} before its first timeout); y's calls: ${y.calls.length}`);
});
