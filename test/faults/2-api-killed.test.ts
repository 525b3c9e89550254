// Fault 2: the API process is killed with SIGKILL while clients keep sending (wait=false and
// wait=true), then started again. Every id a client received, in a 202 or a 200, must exist
// and complete: an acknowledgement is only sent once the request is committed.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { call, loadLoops, spread, tally, type Call } from './support/client.ts';
import { faultContext } from './support/context.ts';
import { lifecycleProblems, queueSummary, requestsWithAttempts, waitUntilTerminal } from './support/rows.ts';
import { privateContent } from './support/run.ts';

t.test('the API killed with SIGKILL under load: every id a client received exists and completes', async (t) => {
  const faults = await faultContext(t, '2-api-killed');
  const env = { WAIT_TIMEOUT_MS: '5000', WORKER_CONCURRENCY: '64' };
  const api = await faults.start('api', { env });
  await faults.start('worker', { env });
  const key = await faults.createKey({ project: 'faults-api-killed', mode: 'test' });

  const calls: (Call & { wait: boolean; content: string })[] = [];
  let sequence = 0;
  const load = loadLoops(32, async () => {
    const wait = sequence % 3 === 0;
    const content = privateContent(`scenario 2 request ${sequence++}`);
    const answer = await call(api.url!, {
      path: '/v1/chat/completions',
      key,
      body: { model: `test-delay-${wait ? 300 : 100}`, messages: [{ role: 'user', content }], wait },
      timeoutMs: 15_000,
    });
    calls.push({ ...answer, wait, content });
    // A refused connection comes back at once; do not spin on it.
    if (answer.status === 0) await sleep(50);
  });

  await sleep(2_000);
  const killedAt = Date.now();
  const exit = await api.kill('SIGKILL');
  t.equal(exit?.signal, 'SIGKILL', 'the API died of SIGKILL');
  await sleep(1_000);
  const restartAt = Date.now();
  await api.start();
  const restartedAt = Date.now();
  await sleep(2_000);
  await load.stop();

  const inFlightAtKill = calls.filter((answer) => answer.sentAt < killedAt && answer.answeredAt >= killedAt);
  // A 202 carries the request's id; a 200 is the chat completion itself, whose id is the
  // stored result's.
  const acknowledged = calls.filter((answer) => answer.status === 202);
  const completions = calls.filter((answer) => answer.status === 200);
  const received = [...acknowledged, ...completions];
  t.comment(`${calls.length} calls: ${tally(calls.map((answer) => answer.status || answer.failure || 'none'))}`);
  t.comment(`${inFlightAtKill.length} calls were in flight at the kill: ${tally(inFlightAtKill.map((answer) => answer.status || answer.failure || 'none'))}`);
  t.comment(`restarted in ${restartedAt - restartAt} ms; ${received.filter((answer) => answer.sentAt < killedAt).length} ids received before the kill, ${received.filter((answer) => answer.sentAt >= restartAt).length} after the restart`);
  t.ok(received.some((answer) => answer.sentAt < killedAt), 'ids were received before the kill');
  t.ok(received.some((answer) => answer.sentAt >= restartedAt), 'and after the restart');
  t.same(
    calls.filter((answer) => answer.status !== 0 && answer.status !== 200 && answer.status !== 202).map((answer) => [answer.status, answer.body]).slice(0, 10),
    [],
    'every answer was a 200 or a 202 (the others are connections the kill cut)',
  );
  t.same(
    calls.filter((answer) => answer.status === 0 && (answer.sentAt > restartedAt || answer.answeredAt < killedAt)).map((answer) => answer.failure).slice(0, 10),
    [],
    'no call failed while the API was up',
  );

  const ids = acknowledged.map((answer) => answer.body.id as string);
  const ended = await waitUntilTerminal(faults.pool, ids, 30_000);
  t.ok(ended.done, `every acknowledged id ended (left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);
  if (!ended.done) t.comment(await queueSummary(faults.pool));
  const stored = await requestsWithAttempts(faults.pool);
  const byId = new Map(stored.map((request) => [request.id, request]));
  const byCompletionId = new Map(stored.flatMap((request) => (request.result ? [[request.result.id as string, request]] : [])));
  t.same(ids.filter((id) => !byId.has(id)), [], `all ${ids.length} acknowledged ids are stored`);
  t.same(
    ids.filter((id) => byId.get(id)?.status !== 'completed').map((id) => [id, byId.get(id)?.status]).slice(0, 10),
    [],
    'and completed',
  );
  t.same(
    completions.filter((answer) => byCompletionId.get(answer.body.id)?.status !== 'completed').map((answer) => answer.body.id).slice(0, 10),
    [],
    `all ${completions.length} completions answered with 200 are stored, completed, with that result`,
  );
  t.same(
    stored.flatMap((request) => lifecycleProblems(request, 5).map((problem) => `${request.id}: ${problem}`)).slice(0, 10),
    [],
    'each by the lifecycle rules',
  );
  const requestOf = (answer: (typeof received)[number]) =>
    answer.status === 202 ? byId.get(answer.body.id) : byCompletionId.get(answer.body.id);
  const wrongResults = received.filter((answer) => {
    const content = requestOf(answer)?.result?.choices?.[0]?.message?.content;
    return content !== answer.content || (answer.status === 200 && answer.body.choices?.[0]?.message?.content !== answer.content);
  });
  t.same(wrongResults.map((answer) => answer.body.id).slice(0, 10), [], 'each answering its own message');
  const requestIds = received.map((answer) => requestOf(answer)?.id);
  t.equal(new Set(requestIds).size, received.length, 'no request was given to two calls');

  const unacknowledged = stored.filter((request) => !requestIds.includes(request.id));
  t.comment(`${stored.length} requests stored: ${received.length} answered (${acknowledged.length} with 202, ${completions.length} with 200), ${unacknowledged.length} committed but cut off before their answer (${tally(unacknowledged.map((request) => request.status))})`);
  t.comment(`answered 202 in: ${spread(acknowledged.filter((answer) => !answer.wait).map((answer) => answer.answeredAt - answer.sentAt))}`);

  await faults.finish(t);
});
