// Fault 3: Postgres stops for 10 s while clients keep sending, then starts again. While it is
// down the API answers only 503 service_unavailable (with retry-after), never a 500, and no
// process crashes; no acknowledged request is lost; within 5 s of its return the answers are
// normal again; every wait=true request that was waiting gets its answer.
import { randomBytes } from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import type { CreatedKey } from '../../src/keys/service.ts';
import { call, loadLoops, spread, tally, type Call } from './support/client.ts';
import { faultContext } from './support/context.ts';
import { errorShapeProblem } from './support/contract.ts';
import { dedicatedPostgres } from './support/postgres.ts';
import { lifecycleProblems, queueSummary, requestsWithAttempts, waitUntilTerminal } from './support/rows.ts';
import { privateContent } from './support/run.ts';

const OUTAGE_MS = 10_000;
const RECOVERY_BOUND_MS = 5_000;
const WAIT_TIMEOUT_MS = 15_000;

type Kind = 'post' | 'post-wait' | 'lookup';
interface Sent extends Call {
  kind: Kind;
  idempotencyKey: string | undefined;
  content: string | undefined;
}

t.test('Postgres stopped for 10 s under load, then started: only 503s while it is down, nothing lost, normal again within 5 s, every waiter answered', async (t) => {
  const postgres = await dedicatedPostgres('3-postgres-outage');
  const faults = await faultContext(t, '3-postgres-outage', { databaseUrl: postgres.url, afterwards: () => postgres.remove() });
  // The worker must out-run the paced submissions below (128 attempts of 300 ms at once: over
  // 400 a second), so that what is left to drain after the outage is the outage's backlog, not
  // an ever-growing one; an unpaced closed loop of accepts outgrows any worker on this machine.
  const env = { WAIT_TIMEOUT_MS: String(WAIT_TIMEOUT_MS), WORKER_CONCURRENCY: '128' };
  const api = await faults.start('api', { env });
  const worker = await faults.start('worker', { env });
  const key = await faults.createKey({ project: 'faults-postgres-outage', mode: 'test' });

  const calls: Sent[] = [];
  const acknowledgedIds: string[] = [];
  // Loops of each kind, so that slow wait=true calls cannot hold up the others.
  const load = loadLoops(16, async (loop) => {
    const kind: Kind = loop < 8 ? 'post' : loop < 12 ? 'post-wait' : acknowledgedIds.length > 0 ? 'lookup' : 'post';
    const sent = await send(api.url!, key, kind, acknowledgedIds);
    calls.push(sent);
    if (sent.status === 202) acknowledgedIds.push(sent.body.id);
    // Not as eager as a tight loop on 503s; the outage still sees hundreds of calls.
    if (sent.status !== 200 && sent.status !== 202) await sleep(100);
    // Accepts paced to a few hundred a second in all (see env).
    else if (kind === 'post') await sleep(10);
  });

  await sleep(3_000);
  const stopAt = Date.now();
  await postgres.stop();
  const downAt = Date.now();
  await sleep(OUTAGE_MS - (downAt - stopAt));
  const startAt = Date.now();
  await postgres.start();
  const upAt = Date.now();
  await sleep(8_000);
  // Keep the load going until a wait=true call sent well after the return has been answered
  // (the backlog built up during the outage can hold such a call for up to WAIT_TIMEOUT_MS).
  const madeAfterReturn = () => calls.some((sent) => sent.kind === 'post-wait' && sent.sentAt >= upAt + RECOVERY_BOUND_MS);
  while (!madeAfterReturn() && Date.now() < upAt + 45_000) await sleep(200);
  await load.stop();
  t.comment(`Postgres stopped in ${downAt - stopAt} ms, was down ${startAt - downAt} ms, started again in ${upAt - startAt} ms`);
  t.comment(`${calls.length} calls: ${tally(calls.map((sent) => sent.status || sent.failure || 'none'))}`);

  t.same(calls.filter((sent) => sent.status === 0).map((sent) => `${sent.kind}: ${sent.failure}`).slice(0, 10), [], 'every call was answered (no connection cut or refused)');
  t.same(calls.filter((sent) => sent.status >= 500 && sent.status !== 503).map((sent) => [sent.kind, sent.status, sent.body]).slice(0, 10), [], 'no 500');
  t.same(
    calls.filter((sent) => ![200, 202, 503].includes(sent.status)).map((sent) => [sent.kind, sent.status, sent.body]).slice(0, 10),
    [],
    'every answer was a 200, a 202 or a 503',
  );
  t.same(
    calls.flatMap((sent) => {
      if (sent.status !== 503) return [];
      const problem = errorShapeProblem(503, sent.headers, sent.body);
      return problem || sent.body?.error?.code !== 'service_unavailable' ? [`${sent.kind}: ${problem ?? sent.body.error.code}`] : [];
    }).slice(0, 10),
    [],
    'every 503 is service_unavailable in the error shape, with retry-after',
  );

  const duringOutage = calls.filter((sent) => sent.sentAt >= downAt && sent.answeredAt <= startAt);
  t.ok(duringOutage.length >= 50, `calls were made while Postgres was down (${duringOutage.length})`);
  t.same(
    duringOutage.filter((sent) => sent.status !== 503).map((sent) => [sent.kind, sent.status]).slice(0, 10),
    [],
    'every call made and answered while Postgres was down was a 503',
  );
  t.comment(`while it was down: ${tally(duringOutage.map((sent) => `${sent.kind} ${sent.status || sent.failure}`))}; answered in ${spread(duringOutage.map((sent) => sent.answeredAt - sent.sentAt))}`);

  t.ok(api.running && worker.running, 'the API and the worker are still running');
  t.same([api.exits, worker.exits], [[], []], 'neither exited nor was restarted');

  // Back to normal: from some moment after Postgres returned, every call is answered 2xx.
  const afterReturn = calls.filter((sent) => sent.sentAt >= upAt);
  const firstNormal = afterReturn.filter((sent) => sent.status === 200 || sent.status === 202).sort((a, b) => a.answeredAt - b.answeredAt)[0];
  const lastAbnormal = afterReturn.filter((sent) => sent.status !== 200 && sent.status !== 202).sort((a, b) => b.sentAt - a.sentAt)[0];
  const normalAgainMs = lastAbnormal ? lastAbnormal.answeredAt - upAt : firstNormal ? firstNormal.answeredAt - upAt : undefined;
  t.comment(
    `after Postgres returned: first normal answer after ${firstNormal ? `${firstNormal.answeredAt - upAt} ms` : 'never'}, ` +
      `last other answer ${lastAbnormal ? `${lastAbnormal.answeredAt - upAt} ms (${lastAbnormal.status || lastAbnormal.failure})` : 'none'}: ` +
      `normal again within ${normalAgainMs ?? 'never'} ms of its return (${(normalAgainMs ?? 0) + (upAt - startAt)} ms after it was started)`,
  );
  t.ok(normalAgainMs !== undefined && normalAgainMs <= RECOVERY_BOUND_MS, 'answers were normal again within 5 s of its return');
  t.same(
    afterReturn.filter((sent) => sent.sentAt >= upAt + RECOVERY_BOUND_MS && sent.status !== 200 && sent.status !== 202).map((sent) => [sent.kind, sent.status]).slice(0, 10),
    [],
    'and stayed normal',
  );
  const waitsAfter = afterReturn.filter((sent) => sent.kind === 'post-wait' && sent.sentAt >= upAt + RECOVERY_BOUND_MS);
  t.ok(waitsAfter.length > 0, 'wait=true requests were made then');
  t.same(
    waitsAfter.filter((sent) => sent.status !== 200 && sent.status !== 202).map((sent) => sent.status),
    [],
    `and answered with their completion or, while the backlog drains, their acknowledgement (${tally(waitsAfter.map((sent) => String(sent.status)))}, in ${spread(waitsAfter.map((sent) => sent.answeredAt - sent.sentAt))})`,
  );

  // Nothing acknowledged is lost: every 202's id and every 200's completion is stored and completes.
  const ended = await waitUntilTerminal(faults.pool, acknowledgedIds, 60_000);
  t.ok(ended.done, `every acknowledged request ended (${acknowledgedIds.length}; left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);
  if (!ended.done) t.comment(await queueSummary(faults.pool));
  const stored = await requestsWithAttempts(faults.pool);
  const byId = new Map(stored.map((request) => [request.id, request]));
  const byKey = new Map(stored.map((request) => [request.idempotency_key, request]));
  t.same(acknowledgedIds.filter((id) => byId.get(id)?.status !== 'completed'), [], `all ${acknowledgedIds.length} acknowledged ids are stored and completed`);
  const completions = calls.filter((sent) => sent.kind !== 'lookup' && sent.status === 200);
  t.same(
    completions.filter((sent) => {
      const request = byKey.get(sent.idempotencyKey!);
      return request?.status !== 'completed' || request.result?.id !== sent.body.id || sent.body.choices?.[0]?.message?.content !== sent.content;
    }).map((sent) => sent.idempotencyKey).slice(0, 10),
    [],
    `all ${completions.length} completions answered with 200 are the stored results of their requests`,
  );
  t.same(
    stored.flatMap((request) => lifecycleProblems(request, 5).map((problem) => `${request.id}: ${problem}`)).slice(0, 10),
    [],
    'every stored request ended by the lifecycle rules',
  );
  const refusedButStored = calls.filter((sent) => sent.kind !== 'lookup' && sent.status === 503 && byKey.has(sent.idempotencyKey!));
  t.comment(`${stored.length} requests stored; ${refusedButStored.length} of them were answered 503 (committed as Postgres went down; a retry with the same idempotency_key finds them)`);

  // Waiters: wait=true requests under way when Postgres stopped.
  const waiters = calls.filter((sent) => sent.kind === 'post-wait' && sent.sentAt < stopAt && sent.answeredAt > stopAt);
  const storedBeforeStop = waiters.filter((sent) => {
    const request = byKey.get(sent.idempotencyKey!);
    return request !== undefined && request.created_at.getTime() < stopAt - 100;
  });
  t.comment(`${waiters.length} wait=true requests were waiting when Postgres stopped: ${tally(waiters.map((sent) => sent.status || sent.failure || 'none'))}; answered ${spread(waiters.map((sent) => sent.answeredAt - stopAt))} after the stop`);
  t.ok(waiters.length > 0, 'wait=true requests were waiting when Postgres stopped');
  t.same(waiters.filter((sent) => sent.status === 0).map((sent) => sent.failure), [], 'every one was answered');
  t.ok(storedBeforeStop.length > 0, 'some of them were stored well before the stop');
  t.same(
    storedBeforeStop.filter((sent) => sent.status !== 200 && sent.status !== 202).map((sent) => [sent.status, sent.body?.error?.code]),
    [],
    `those stored before the stop (${storedBeforeStop.length}) with their completion (200) or their acknowledgement (202), never a 503`,
  );
  t.same(
    storedBeforeStop.filter((sent) => sent.answeredAt - sent.sentAt > WAIT_TIMEOUT_MS + 2_000).map((sent) => sent.answeredAt - sent.sentAt),
    [],
    'and within the wait timeout',
  );

  await faults.finish(t);
});

async function send(baseUrl: string, key: CreatedKey, kind: Kind, acknowledged: string[]): Promise<Sent> {
  if (kind === 'lookup') {
    const id = acknowledged[Math.floor(Math.random() * acknowledged.length)]!;
    const answer = await call(baseUrl, { path: `/v1/requests/${id}`, key, timeoutMs: 30_000 });
    return { ...answer, kind, idempotencyKey: undefined, content: undefined };
  }
  const wait = kind === 'post-wait';
  const idempotencyKey = `faults-3-${randomBytes(9).toString('base64url')}`;
  const content = privateContent(`scenario 3 ${idempotencyKey}`);
  const answer = await call(baseUrl, {
    path: '/v1/chat/completions',
    key,
    body: {
      model: wait ? 'test-delay-1000' : 'test-delay-300',
      messages: [{ role: 'user', content }],
      wait,
      idempotency_key: idempotencyKey,
    },
    timeoutMs: WAIT_TIMEOUT_MS + 20_000,
  });
  return { ...answer, kind, idempotencyKey, content };
}
