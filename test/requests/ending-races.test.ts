// The ways a request ends, racing each other: the upstream's answer (after a failure and a retry,
// for some), the client's cancel, and the expiry of its deadline, all within the same second or
// two. Twice: with the API and the worker in processes of their own (the cancel reaches the
// worker's call through the database), and in one process (where a wait=true request may be
// started by its accept). Whatever wins, each request ends once, in one state its rows, its
// webhook event and its wait=true answer all agree on: a completed request has exactly one
// succeeded attempt, its last; a failed or cancelled one has none; no attempt is left running,
// started after the request ended, or ended before it started.
import t, { type Test } from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { mulberry32 } from '../helpers/random.ts';
import { attemptRows, isTerminal, requestRow, waitForRow } from '../helpers/rows.ts';
import { completionFor, startFakeUpstream } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';
import { addTestEndpoint, startReceiver } from '../webhooks/support.ts';

const REQUESTS = 120;
const DEADLINE_MS = 1_000;
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

// The moments are drawn at random, from a seed the run prints: ENDING_RACES_SEED=<seed> draws
// them again.
const SEED = Number(process.env.ENDING_RACES_SEED ?? Math.floor(Math.random() * 2 ** 31));
const draw = mulberry32(SEED);
const between = (min: number, max: number) => Math.round(min + draw() * (max - min));
// Request i's answer comes this long after its call (its first call fails with a 503 instead, for
// every fourth), and every third is cancelled this long after it was sent: on both sides of the
// deadline, before, during and after its calls.
const answerAfter = Array.from({ length: REQUESTS }, () => between(300, 1_800));
const cancelAfter = Array.from({ length: REQUESTS }, (_, i) => (i % 3 === 0 ? between(0, 1_500) : undefined));

t.comment(`ENDING_RACES_SEED=${SEED}`);

// A round races only if the machine keeps up: a stall of a second (a busy host) lets every
// deadline pass before any answer or cancel. Such a round still checks how each request ended,
// and is run again, on a gateway of its own, until the answer, the cancel and the deadline have
// each won some (three rounds at most).
const ROUNDS = 3;
const ENDS = ['completed', 'cancelled', 'failed deadline_exceeded'];

for (const apart of [true, false]) {
  t.test(`answers, retries, cancels and deadlines racing, ${apart ? 'the API and the worker apart' : 'in one process'}: each request ends once, and its rows, its event and its wait=true answer agree`, async (t) => {
    let missing = ENDS;
    for (let round = 1; round <= ROUNDS && missing.length > 0; round++) {
      let ended: Record<string, number> = {};
      await t.test(`round ${round}`, async (t) => {
        ended = await race(t, apart);
      });
      missing = ENDS.filter((end) => !Object.entries(ended).some(([seen, count]) => seen.startsWith(end) && count > 0));
      if (missing.length > 0) t.comment(`round ${round} saw no request end ${missing.join(', ')}`);
    }
    t.same(missing, [], 'the answer, the cancel and the deadline each won some');
  });
}

/**
 * The races, on a gateway of their own: its API and its worker in two processes (apart), or in
 * one. Returns how many requests ended each way.
 */
async function race(t: Test, apart: boolean): Promise<Record<string, number>> {
  const failedOnce = new Set<number>();
  const upstream = await startFakeUpstream(t, async (call) => {
    const content = (call.body as { messages: { content: string }[] }).messages[0]!.content;
    const i = Number(/race (\d+)/.exec(content)?.[1]);
    if (i % 4 === 0 && !failedOnce.has(i)) {
      failedOnce.add(i);
      await sleep(answerAfter[i]! / 4);
      return { status: 503, json: { error: { message: 'overloaded' } } };
    }
    await sleep(answerAfter[i]!);
    return { status: 200, json: completionFor(call.body) };
  });
  const env = { UPSTREAM_BASE_URL: upstream.baseUrl, WEBHOOK_ALLOW_PRIVATE: 'true', UPSTREAM_TIMEOUT_MS: '5000', WAIT_TIMEOUT_MS: '10000' };
  const api = await startTestGateway(t, { role: apart ? 'api' : 'all', env });
  if (apart) await startTestGateway(t, { role: 'worker', env, databaseUrl: api.databaseUrl });
  const key = await api.createKey({ mode: 'live', deadlineMs: DEADLINE_MS });
  const receiver = await startReceiver(t);
  receiver.secrets.push((await addTestEndpoint(api, { url: receiver.url })).secret);
  const client = clientFor(api.url, key);

  const sent = await Promise.all(
    Array.from({ length: REQUESTS }, async (_, i) => {
      const wait = i % 2 === 1;
      const pending = client.post({ model: 'gpt-race', messages: userMessage(`race ${i}`), ...(wait ? { wait: true } : {}) });
      // (A wait=true request is cancelled while its client waits.)
      const delay = cancelAfter[i];
      const cancel =
        delay === undefined
          ? undefined
          : sleep(delay).then(async () => (await send(api.url, { method: 'POST', path: `/v1/requests/${await storedId(i)}/cancel`, key })).status);
      const answer = await pending;
      return { i, wait, answer, id: await storedId(i), cancelStatus: await cancel };
    }),
  );

  /** Request i's id, once it is stored (a wait=true request's completion carries the upstream's id, not ours). */
  async function storedId(i: number): Promise<string> {
    for (;;) {
      const { rows } = await api.pool.query<{ id: string }>(`select id from gateway.requests where body -> 'messages' -> 0 ->> 'content' = $1`, [`race ${i}`]);
      if (rows[0]) return rows[0].id;
      await sleep(20);
    }
  }

  t.same(sent.filter(({ answer }) => answer.status !== 200 && answer.status !== 202).map(({ i, answer }) => `${i}: ${answer.status}`), [], 'every submission answered 200 or 202');
  t.same(sent.filter(({ cancelStatus }) => cancelStatus !== undefined && cancelStatus !== 200 && cancelStatus !== 409).map(({ i, cancelStatus }) => `${i}: ${cancelStatus}`), [], 'every cancel answered 200 or 409');

  const ended: Record<string, number> = {};
  const problems: string[] = [];
  for (const { i, id, wait, answer } of sent) {
    const row = await waitForRow(api.db, id, isTerminal, 15_000);
    const end = `${row.status} ${row.last_error_code ?? ''}`.trim();
    ended[end] = (ended[end] ?? 0) + 1;
    const attempts = await attemptRows(api.db, id);
    const succeeded = attempts.filter((attempt) => attempt.outcome === 'succeeded');
    const say = (problem: string) => problems.push(`request ${i} (${row.status}): ${problem}`);
    if (attempts.length !== row.attempts) say(`attempts ${row.attempts}, but ${attempts.length} attempt rows`);
    attempts.forEach((attempt, index) => {
      if (attempt.attempt_number !== index + 1) say(`attempt rows numbered ${attempts.map((a) => a.attempt_number).join(',')}`);
      if (attempt.outcome === 'running') say(`attempt ${attempt.attempt_number} left running`);
      if (attempt.started_at > row.finished_at!) say(`attempt ${attempt.attempt_number} started after the request ended`);
      if (attempt.finished_at && attempt.finished_at < attempt.started_at) say(`attempt ${attempt.attempt_number} ended before it started`);
    });
    if (row.status === 'completed') {
      if (succeeded.length !== 1 || attempts.at(-1)?.outcome !== 'succeeded') say(`${succeeded.length} succeeded attempts, the last ${attempts.at(-1)?.outcome}`);
      if (!row.result) say('no result');
    } else {
      if (succeeded.length !== 0) say(`${succeeded.length} succeeded attempts`);
      if (row.result !== null) say('a result');
    }
    if (row.status === 'failed' && row.last_error_code === 'deadline_exceeded' && row.finished_at! < row.deadline_at!) say('failed for its deadline before it');
    if (wait) {
      // The wait=true answer: the completion, or the acknowledgement of the end it met.
      const told = answer.status === 200 ? 'completed' : (answer.body.status as string);
      if (told !== row.status) say(`its wait=true answer says ${told}`);
    }
  }
  t.same(problems.slice(0, 20), [], `each request ended once, its rows agreeing (${problems.length} problems)`);
  t.comment(`ended: ${JSON.stringify(ended)}`);

  await until(() => new Set(receiver.deliveries.map((delivery) => delivery.headers['webhook-id'])).size >= REQUESTS, 'an event for each request', 15_000);
  // Time for a second event of a request, were there one.
  await sleep(500);
  const eventProblems: string[] = [];
  for (const { i, id } of sent) {
    const row = await requestRow(api.db, id);
    const events = receiver.deliveries.filter((delivery) => delivery.event?.data.id === id);
    const types = [...new Set(events.map((delivery) => delivery.event!.type))];
    const messages = new Set(events.map((delivery) => delivery.headers['webhook-id']));
    if (messages.size !== 1 || types.length !== 1 || types[0] !== `request.${row!.status}`) {
      eventProblems.push(`request ${i} (${row!.status}): events ${types.join(', ')} in ${messages.size} messages`);
    }
  }
  t.same(eventProblems.slice(0, 20), [], 'each request has one event, of the end it met');
  return ended;
}
