// Fault 7: a project's webhook receiver is down for 30 s while 2,000 requests end over about
// 20 s, then comes back. Deliveries to it fail (connection refused) and are retried on the
// schedule; once it is back, every event must reach it, verified by the official
// standardwebhooks package, of its request's final status: none lost, each exactly once after
// deduplication on webhook-id (a duplicate is a retry of the same id).
import t from 'tap';
import { call, spread, tally, type Call } from './support/client.ts';
import { faultContext } from './support/context.ts';
import { setTimeout as sleep } from 'node:timers/promises';
import { queueSummary, waitUntilTerminal } from './support/rows.ts';
import { privateContent } from './support/run.ts';
import { startWebhookReceiver } from './support/webhook-receiver.ts';

const SCENARIO = '7-webhook-receiver-down';
const REQUESTS = 2_000;
const LOAD_MS = 20_000;
const DOWN_AT_MS = 3_000;
const DOWN_FOR_MS = 30_000;
// Waits between tries: 63 s in all (57 s at the least, with jitter), longer than the outage,
// so no event exhausts its retries while the receiver is down.
const RETRY_SCHEDULE = '1000,2000,4000,8000,16000,32000';

t.test('a webhook receiver down for 30 s while 2,000 requests end: once it is back, every event reaches it, verified, none lost', async (t) => {
  const receiver = await startWebhookReceiver(t);
  const faults = await faultContext(t, SCENARIO);
  const env = { WEBHOOK_ALLOW_PRIVATE: 'true', WEBHOOK_RETRY_SCHEDULE: RETRY_SCHEDULE };
  const api = await faults.start('api', { env });
  await faults.start('worker', { env });
  const key = await faults.createKey({ project: 'faults-webhooks', mode: 'test' });
  const endpoint = await faults.addEndpoint({ project: 'faults-webhooks', url: receiver.url });
  receiver.secret = endpoint.secret;

  // 100 requests a second for 20 s, 1 in 10 failing; the receiver goes down 3 s in.
  const startedAt = Date.now();
  let downAt = 0;
  let upAt = 0;
  const outage = (async () => {
    await sleep(DOWN_AT_MS);
    await receiver.down();
    downAt = Date.now();
    await sleep(DOWN_FOR_MS);
    await receiver.up();
    upAt = Date.now();
  })();
  const sent: Promise<Call>[] = [];
  for (let i = 0; i < REQUESTS; i++) {
    const due = startedAt + (i * LOAD_MS) / REQUESTS;
    if (due > Date.now()) await sleep(due - Date.now());
    sent.push(
      call(api.url!, {
        path: '/v1/chat/completions',
        key,
        body: { model: i % 10 === 9 ? 'test-error-400' : 'test-echo', messages: [{ role: 'user', content: privateContent(`scenario 7 request ${i}`) }] },
      }),
    );
  }
  const accepted = await Promise.all(sent);
  t.comment(`sent ${REQUESTS} requests in ${Date.now() - startedAt} ms`);
  t.same(tally(accepted.map((answer) => answer.status)), `202: ${REQUESTS}`, `all ${REQUESTS} acknowledged`);
  const unanswered = accepted.filter((answer) => answer.status === 0);
  if (unanswered.length > 0) t.comment(`no answer: ${tally(unanswered.map((answer) => answer.failure ?? ''))}`);
  const ids = accepted.filter((answer) => answer.status === 202).map((answer) => answer.body.id as string);
  const ended = await waitUntilTerminal(faults.pool, ids, 60_000);
  t.ok(ended.done, `all ended (left: ${ended.left}, by status: ${JSON.stringify(ended.byStatus)})`);
  await outage;
  t.comment(`the receiver was down from ${downAt - startedAt} ms to ${upAt - startedAt} ms after the first request`);

  const finished = async () => {
    const { rows } = await faults.pool.query<{ unfinished: number }>(
      `select count(*)::int as unfinished from gateway.webhook_messages where finished_at is null`,
    );
    return rows[0]!.unfinished;
  };
  const deadline = Date.now() + 120_000;
  while ((await finished()) > 0 && Date.now() < deadline) await sleep(500);
  const left = await finished();
  t.equal(left, 0, `every message finished (left: ${left})`);
  if (left > 0) t.comment(await queueSummary(faults.pool));
  const lastDelivery = Math.max(...receiver.deliveries.map((delivery) => delivery.receivedAt));
  t.comment(`the last delivery arrived ${lastDelivery - upAt} ms after the receiver came back`);

  const { rows: messages } = await faults.pool.query<{ id: string; request_id: string; event_type: string; status: string; tries: number; created_at: Date; request_status: string }>(
    `select messages.id, messages.request_id, messages.event_type, messages.status, messages.tries, messages.created_at,
            requests.status as request_status
     from gateway.webhook_messages as messages join gateway.requests on requests.id = messages.request_id`,
  );
  t.equal(messages.length, REQUESTS, 'one message per request');
  t.same(new Set(messages.map((message) => message.request_id)), new Set(ids), 'for every request');
  t.equal(tally(messages.map((message) => message.status)), `delivered: ${REQUESTS}`, 'all delivered: none failed, none abandoned');

  const byId = new Map<string, typeof receiver.deliveries>();
  for (const delivery of receiver.deliveries) byId.set(delivery.id, [...(byId.get(delivery.id) ?? []), delivery]);
  const problems: string[] = [];
  for (const message of messages) {
    const received = byId.get(message.id) ?? [];
    if (received.length === 0) problems.push(`${message.id}: never received`);
    for (const delivery of received) {
      if (!delivery.verified) problems.push(`${message.id}: standardwebhooks did not verify a delivery`);
      else if (delivery.event?.type !== `request.${message.request_status}` || delivery.event.data.id !== message.request_id) {
        problems.push(`${message.id}: ${delivery.event?.type} of ${delivery.event?.data.id}, for the ${message.request_status} request ${message.request_id}`);
      }
    }
  }
  t.same(problems.slice(0, 20), [], `every event received and verified, of its request and its final status (${problems.length} problems)`);
  const known = new Set(messages.map((message) => message.id));
  t.same([...byId.keys()].filter((id) => !known.has(id)), [], 'nothing else received');
  t.equal(byId.size, REQUESTS, `${REQUESTS} distinct webhook-ids: each event exactly once after deduplication`);

  // The outage reached the gateway: its tries while the receiver was down failed (and, as all
  // were delivered, each such message was tried again).
  const { rows: tries } = await faults.pool.query<{ outcome: string; error: string | null; started_at: Date }>(
    `select outcome, error, started_at from gateway.webhook_deliveries`,
  );
  // (Well inside the outage: a try started as it ended may reach the receiver back up.)
  const triedWhileDown = tries.filter((row) => row.started_at.getTime() > downAt && row.started_at.getTime() < upAt - 1_000);
  t.ok(triedWhileDown.length > 0, `${triedWhileDown.length} tries were made while the receiver was down`);
  t.same(triedWhileDown.filter((row) => row.outcome !== 'failed').slice(0, 5), [], 'and each of them failed');
  const duplicates = receiver.deliveries.length - byId.size;
  const firstReceipt = messages.map((message) => Math.min(...(byId.get(message.id) ?? []).map((delivery) => delivery.receivedAt)) - message.created_at.getTime());
  t.comment(`tries: ${tries.length} (${tally(tries.map((row) => `${row.outcome}${row.error ? ` (${row.error})` : ''}`))})`);
  t.comment(`tries per message: ${tally(messages.map((message) => message.tries))}`);
  t.comment(`events: ${tally(messages.map((message) => message.event_type))}; received ${receiver.deliveries.length} deliveries, ${duplicates} of them duplicates`);
  t.comment(`delay from the request's end to the event's arrival: ${spread(firstReceipt)}`);
  const duringOutage = messages.filter((message) => message.created_at.getTime() >= downAt && message.created_at.getTime() < upAt);
  t.comment(`the ${duringOutage.length} events of requests that ended during the outage arrived ${spread(duringOutage.map((message) => Math.min(...(byId.get(message.id) ?? []).map((delivery) => delivery.receivedAt)) - upAt))} after it ended`);

  await faults.finish(t);
});
