// Fault 9: processes killed again and again while everything else goes on. Two API processes
// and two workers share the database. The upstream answers late, and fails at random (429s,
// 5xx, resets, hangs past the timeout, a request's own 400s); one of its two models takes four
// calls at a time, and each worker makes eight at most. Clients wait for some answers
// (wait=true) and not for others, cancel some requests, and send those of one key with a 2 s
// deadline; when the API they sent to dies, or (for a tenth of them) when they tire of waiting
// for its first answer, they send again to the other with the same idempotency_key, the first
// try perhaps still under way. A webhook receiver fails a quarter of the deliveries. Meanwhile,
// one process after another is killed (SIGKILL, or SIGTERM and its grace) and started again, and
// Postgres ends one of the gateway's connections every half second or so.
//
// Nothing may be lost or done twice: every submission is answered in the end, each idempotency
// key names one request, every request ends once, in one state its rows, its client's answers
// and its one webhook event agree on, and a completed request's result is a completion the
// upstream sent for it. The moments are drawn from a seed the run prints (KILLS_SEED draws them
// again; the machine's own timing still differs).
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { KEEP_ALIVE_TIMEOUT_MS } from '../../src/http/server.ts';
import type { CreatedKey } from '../../src/keys/service.ts';
import type { GatewayProcess } from '../helpers/serve.ts';
import { mulberry32 } from '../helpers/random.ts';
import { completionFor, startFakeUpstream, type Reply } from '../helpers/upstream.ts';
import { upstreamsFile } from '../helpers/upstreams-file.ts';
import { startReceiver } from '../webhooks/support.ts';
import { call, tally, type Call } from './support/client.ts';
import { faultContext } from './support/context.ts';
import { queueSummary, requestsWithAttempts } from './support/rows.ts';
import { privateContent } from './support/run.ts';

type Random = () => number;

const REQUESTS = 360;
const SEND_MS = 12_000;
const DEADLINE_MS = 2_000;
const MAX_ATTEMPTS = 5;
const SEED = Number(process.env.KILLS_SEED ?? Math.floor(Math.random() * 2 ** 31));
// How long a process given SIGTERM may take to exit before it is killed (and the test fails). An
// API given SIGTERM here has, once in some forty runs, answered every request and kept one idle
// keep-alive connection of a client open, so that it did not exit for over 10 s; such a
// connection is closed at KEEP_ALIVE_TIMEOUT_MS at the latest. Why it stays open is not found yet.
const SIGTERM_GRACE_MS = KEEP_ALIVE_TIMEOUT_MS + 10_000;

t.comment(`KILLS_SEED=${SEED}`);

t.test('processes killed again and again amid failing calls, cancels, deadlines and failing webhooks: nothing lost, nothing done twice, every request ends once', async (t) => {
  // A generator each for the plan of requests, the kills, the connections ended, the upstream and
  // the receiver, so that the plan and the kills are drawn again alike whatever order the calls
  // come in.
  const [planned, killed, cut, answered, received] = [1, 2, 3, 4, 5].map((stream) => mulberry32(SEED + stream)) as [Random, Random, Random, Random, Random];
  const between = (random: Random, min: number, max: number) => Math.round(min + random() * (max - min));

  // The upstream: the ids of the completions it sent, by request.
  const sentCompletions = new Map<number, Set<string>>();
  const upstream = await startFakeUpstream(t, (received): Reply => {
    const content = (received.body as { messages: { content: string }[] }).messages[0]!.content;
    const i = Number(/scenario 9 request (\d+) /.exec(content)?.[1]);
    const draw = answered();
    if (draw < 0.1) return { status: 503, json: { error: { message: 'overloaded' } }, delayMs: between(answered, 20, 300) };
    if (draw < 0.18) return { status: 429, json: { error: { message: 'slow down' } }, headers: { 'retry-after': String(between(answered, 0, 1)) } };
    if (draw < 0.24) return { reset: true };
    if (draw < 0.28) return { hang: true };
    if (draw < 0.3) return { status: 400, json: { error: { message: 'bad request' } } };
    const completion = completionFor(received.body as { messages: { content: string }[] });
    sentCompletions.set(i, (sentCompletions.get(i) ?? new Set()).add(completion.id));
    return { status: 200, json: completion, delayMs: between(answered, 100, 1_500) };
  });

  const faults = await faultContext(t, '9-kills-amid-races');
  const env = {
    // Two live models on the one upstream: one whose lane takes four calls at a time, and one
    // without limits. A worker makes at most eight live calls at once: queues wait for room on
    // their lane and in a worker, woken by calls that end in a process that may be killed.
    UPSTREAMS_FILE: await upstreamsFile(t, [
      { name: 'capped', base_url: upstream.baseUrl, models: ['gpt-capped'], limits: { max_concurrent: 4 } },
      { name: 'open', base_url: upstream.baseUrl, models: ['gpt-kills'] },
    ]),
    MAX_IN_FLIGHT: '8',
    UPSTREAM_TIMEOUT_MS: '2000',
    MAX_ATTEMPTS: String(MAX_ATTEMPTS),
    WAIT_TIMEOUT_MS: '8000',
    WORKER_DEAD_AFTER_MS: '3000',
    SHUTDOWN_GRACE_MS: '1000',
    WEBHOOK_ALLOW_PRIVATE: 'true',
    WEBHOOK_TIMEOUT_MS: '2000',
    WEBHOOK_RETRY_SCHEDULE: '100,200,300,500,500,500,500,500,500,500',
  };
  const apis = [await faults.start('api', { label: 'api-a', env }), await faults.start('api', { label: 'api-b', env })];
  const workers = [await faults.start('worker', { label: 'worker-a', env }), await faults.start('worker', { label: 'worker-b', env })];
  const processes = [...apis, ...workers];

  const keys = {
    plain: await faults.createKey({ project: 'faults-kills-plain', mode: 'live' }),
    deadline: await faults.createKey({ project: 'faults-kills-deadline', mode: 'live', deadlineMs: DEADLINE_MS }),
    test: await faults.createKey({ project: 'faults-kills-test', mode: 'test' }),
  };
  const delivered = new Set<string>();
  const receiver = await startReceiver(t, (delivery) => {
    if (received() < 0.25) return { status: 500 };
    delivered.add(String(delivery.headers['webhook-id']));
    return { status: 204 };
  });
  for (const project of ['faults-kills-plain', 'faults-kills-deadline', 'faults-kills-test']) {
    receiver.secrets.push((await faults.addEndpoint({ project, url: receiver.url })).secret);
  }

  // The kills: every second or so a process that is up (not being stopped or started), never both
  // APIs at once, each started again a moment later, until the clients have their answers.
  const kills: string[] = [];
  const restarts: Promise<void>[] = [];
  const down = new Set<GatewayProcess>();
  let sending = true;
  const killing = (async () => {
    while (sending) {
      await sleep(between(killed, 300, 1_000));
      const target = processes[Math.floor(killed() * processes.length)]!;
      const graceful = killed() < 0.3;
      const restartAfter = between(killed, 200, 800);
      if (down.has(target) || (apis.includes(target) && apis.some((api) => down.has(api)))) continue;
      down.add(target);
      kills.push(`${target.label} ${graceful ? 'SIGTERM' : 'SIGKILL'}`);
      const restart = (graceful ? target.stop(SIGTERM_GRACE_MS) : target.kill('SIGKILL'))
        .then(() => sleep(restartAfter))
        .then(() => target.start())
        .finally(() => down.delete(target));
      restarts.push(restart);
    }
    await Promise.all(restarts);
  })();

  // And Postgres ends one of the gateway's connections now and then, as an administrator's
  // pg_terminate_backend, a failover or a proxy's restart would: statements under way fail, and
  // the LISTEN connection is lost.
  const terminated: string[] = [];
  const terminating = (async () => {
    while (sending) {
      await sleep(between(cut, 200, 800));
      const { rows } = await faults.pool.query<{ application_name: string }>(
        `select application_name, pg_terminate_backend(pid) from pg_stat_activity
         where datname = current_database() and application_name like 'gateway-%' and pid <> pg_backend_pid()
         order by random() limit 1`,
      );
      terminated.push(...rows.map((row) => row.application_name));
    }
  })();

  interface Sent {
    i: number;
    kind: keyof typeof keys;
    wait: boolean;
    idempotencyKey: string;
    /** Every try, the last the one answered (200 or 202), unless none was. */
    tries: Call[];
    cancel: number | undefined;
    /** The last answer to its cancel (200 or 409), if one was sent. */
    cancelStatus: number | undefined;
  }

  /**
   * Sends until an API answers it: to the other API after a connection that died, a 503 (shutting
   * down, its database connection lost), or a first try given up after `firstTimeoutMs` (a client
   * that does not wait long, while its first try may still be stored and run).
   */
  async function send(path: string, key: CreatedKey, body: unknown, first: number, firstTimeoutMs = 20_000): Promise<Call[]> {
    const tries: Call[] = [];
    const giveUpAt = Date.now() + 60_000;
    for (let n = first; ; n++) {
      const timeoutMs = n === first ? firstTimeoutMs : 20_000;
      const answer = await call(apis[n % 2]!.url!, { method: 'POST', path, key, body, timeoutMs });
      tries.push(answer);
      if ((answer.status !== 0 && answer.status !== 503) || Date.now() > giveUpAt) return tries;
      await sleep(100);
    }
  }

  /**
   * The id of the request stored under the idempotency key, once it is (its client sends until it
   * is). A look that fails (the test's own pool waits for a connection on a machine as busy as the
   * gateway's) is made again.
   */
  async function idOf(idempotencyKey: string): Promise<string> {
    const giveUpAt = Date.now() + 90_000;
    for (;;) {
      const look = await faults.pool
        .query<{ id: string }>('select id from gateway.requests where idempotency_key = $1', [idempotencyKey])
        .catch((error: unknown) => error as Error);
      if (!(look instanceof Error) && look.rows[0]) return look.rows[0].id;
      if (Date.now() > giveUpAt) throw look instanceof Error ? look : new Error(`no request was stored under ${idempotencyKey}`);
      await sleep(200);
    }
  }

  const plan = Array.from({ length: REQUESTS }, (_, i) => {
    const kind = i % 5 === 4 ? 'test' : i % 5 === 3 ? 'deadline' : 'plain';
    return {
      i,
      kind: kind as keyof typeof keys,
      wait: planned() < 0.5,
      at: (i * SEND_MS) / REQUESTS,
      first: Math.floor(planned() * 2),
      cancel: planned() < 0.15 ? between(planned, 0, 2_500) : undefined,
      impatient: planned() < 0.1 ? between(planned, 20, 400) : undefined,
    };
  });
  const started = Date.now();
  const sent = await Promise.all(
    plan.map(async ({ i, kind, wait, at, first, cancel, impatient }): Promise<Sent> => {
      await sleep(at);
      const key = keys[kind];
      const idempotencyKey = `scenario-9-${SEED}-${i}`;
      const body = {
        model: kind === 'test' ? 'test-delay-300' : i % 2 === 0 ? 'gpt-capped' : 'gpt-kills',
        messages: [{ role: 'user', content: privateContent(`scenario 9 request ${i}`) }],
        wait,
        idempotency_key: idempotencyKey,
      };
      const cancelled =
        cancel === undefined
          ? Promise.resolve(undefined)
          : sleep(cancel).then(async () => (await send(`/v1/requests/${await idOf(idempotencyKey)}/cancel`, key, undefined, first + 1)).at(-1)!.status);
      const tries = await send('/v1/chat/completions', key, body, first, impatient);
      return { i, kind, wait, idempotencyKey, tries, cancel, cancelStatus: await cancelled };
    }),
  );
  sending = false;
  await Promise.all([killing, terminating]);
  t.comment(`sent ${REQUESTS} requests in ${Date.now() - started} ms; ${kills.length} kills: ${tally(kills)}`);
  t.ok(kills.length >= 3, `processes were killed while the clients sent (${kills.length} times)`);
  t.comment(`${terminated.length} of the gateway's connections ended by Postgres: ${tally(terminated)}`);
  const retried = sent.filter(({ tries }) => tries.length > 1);
  t.comment(`${retried.length} submissions were sent again after their API died, shut down or answered 503; the tries: ${tally(sent.flatMap(({ tries }) => tries.map((answer) => answer.status || answer.failure || 'none')))}`);

  const unanswered = sent.filter(({ tries }) => ![200, 202].includes(tries.at(-1)!.status));
  t.same(unanswered.map(({ i, tries }) => `${i}: ${tries.at(-1)!.status} ${JSON.stringify(tries.at(-1)!.body)?.slice(0, 200)}`).slice(0, 10), [], 'every submission was answered 200 or 202 in the end');
  const badCancels = sent.filter(({ cancelStatus }) => cancelStatus !== undefined && cancelStatus !== 200 && cancelStatus !== 409);
  t.same(badCancels.map(({ i, cancelStatus }) => `${i}: ${cancelStatus}`), [], 'every cancel was answered 200 or 409 in the end');

  // One request per idempotency key.
  const { rows: perKey } = await faults.pool.query<{ idempotency_key: string; count: number }>(
    'select idempotency_key, count(*)::int as count from gateway.requests group by idempotency_key',
  );
  t.equal(perKey.length, REQUESTS, `${REQUESTS} idempotency keys stored`);
  t.same(perKey.filter(({ count }) => count !== 1), [], 'each names one request');

  // Every request ends.
  const { rows: stored } = await faults.pool.query<{ id: string; idempotency_key: string }>(
    'select id, idempotency_key from gateway.requests where idempotency_key = any($1::text[])',
    [sent.map(({ idempotencyKey }) => idempotencyKey)],
  );
  const idByKey = new Map(stored.map((row) => [row.idempotency_key, row.id]));
  const ids = sent.map(({ idempotencyKey }) => idByKey.get(idempotencyKey)!);
  if (idByKey.size < REQUESTS) return; // (said above: the rest would be about requests not stored)
  const endBy = Date.now() + 120_000;
  let left = REQUESTS;
  while (Date.now() < endBy) {
    const { rows } = await faults.pool.query<{ count: number }>(
      `select count(*)::int as count from gateway.requests where status not in ('completed', 'failed', 'cancelled')`,
    );
    left = rows[0]!.count;
    if (left === 0) break;
    await sleep(250);
  }
  t.equal(left, 0, `every request ended (${left} left)`);
  if (left > 0) t.comment(await queueSummary(faults.pool));

  const rows = new Map((await requestsWithAttempts(faults.pool, ids)).map((row) => [row.id, row]));
  const { rows: deadlines } = await faults.pool.query<{ id: string; deadline_at: Date }>('select id, deadline_at from gateway.requests');
  const deadlineOf = new Map(deadlines.map((row) => [row.id, row.deadline_at]));
  const ended: string[] = [];
  const problems: string[] = [];
  sent.forEach(({ i, kind, wait, tries, cancel, cancelStatus }, index) => {
    const id = ids[index]!;
    const row = rows.get(id)!;
    const say = (problem: string) => problems.push(`request ${i} (${kind}, ${row.status}): ${problem}`);
    ended.push(`${row.status} ${row.last_error_code ?? ''}`.trim());
    const attempts = row.attempt_rows;
    if (attempts.length !== row.attempts) say(`attempts ${row.attempts}, but ${attempts.length} attempt rows`);
    attempts.forEach((attempt, n) => {
      if (attempt.attempt_number !== n + 1) say(`attempt rows numbered ${attempts.map((a) => a.attempt_number).join(',')}`);
      if (attempt.outcome === 'running') say(`attempt ${attempt.attempt_number} left running`);
      if (row.finished_at && attempt.started_at > row.finished_at) say(`attempt ${attempt.attempt_number} started after the request ended`);
      if (attempt.finished_at && attempt.finished_at < attempt.started_at) say(`attempt ${attempt.attempt_number} ended before it started`);
    });
    const succeeded = attempts.filter((attempt) => attempt.outcome === 'succeeded');
    if (row.status === 'completed') {
      if (succeeded.length !== 1 || attempts.at(-1)?.outcome !== 'succeeded') say(`${succeeded.length} succeeded attempts, the last ${attempts.at(-1)?.outcome}`);
      if (kind !== 'test' && !sentCompletions.get(i)?.has(row.result?.id)) say(`its result ${row.result?.id} is none of the completions the upstream sent for it`);
    } else {
      if (succeeded.length !== 0) say(`${succeeded.length} succeeded attempts`);
      if (row.result !== null) say('a result');
    }
    if (row.charged_attempts > MAX_ATTEMPTS) say(`${row.charged_attempts} attempts charged, more than MAX_ATTEMPTS`);
    if (row.status === 'cancelled' && cancel === undefined) say('cancelled, though no cancel was sent');
    if (cancelStatus === 200 && row.status !== 'cancelled') say('its cancel was answered 200');
    if (row.last_error_code === 'deadline_exceeded') {
      if (kind !== 'deadline') say('failed for a deadline its key does not have');
      if (row.finished_at! < deadlineOf.get(id)!) say('failed for its deadline before it');
    }
    // What its client was told: the completion (200), or an acknowledgement with a status.
    const answer = tries.at(-1)!;
    if (answer.status === 200) {
      if (!wait) say('answered 200 without wait');
      if (row.status !== 'completed' || answer.body?.id !== row.result?.id) say(`its client was given the completion ${answer.body?.id}, its row says ${row.result?.id ?? 'none'}`);
    } else if (answer.status === 202) {
      if (answer.body?.id !== id) say(`acknowledged as ${answer.body?.id}, stored as ${id}`);
      const told = answer.body?.status as string;
      if (['completed', 'failed', 'cancelled'].includes(told) && told !== row.status) say(`its acknowledgement says ${told}`);
    }
  });
  t.comment(`ended: ${tally(ended)}`);
  const rescued = workers.flatMap((worker) => worker.entries().filter((entry) => entry.component === 'rescue'));
  t.comment(`rescues of queues and webhook endpoints left with nothing to wake them (worker/rescue.ts): ${rescued.length}`);
  t.same(problems.slice(0, 20), [], `each request ended once, its rows and its client's answers agreeing (${problems.length} problems)`);
  t.ok(ended.some((end) => end === 'completed') && ended.some((end) => end === 'cancelled') && ended.some((end) => end === 'failed deadline_exceeded'), 'completions, cancels and deadlines each ended some');

  // One event per request, of the end it met, delivered in the end.
  const deliveredBy = Date.now() + 60_000;
  const eventsOf = () => {
    const byRequest = new Map<string, { types: Set<string>; messages: Set<string> }>();
    for (const delivery of receiver.deliveries) {
      const requestId = delivery.event?.data.id as string | undefined;
      if (!requestId) continue;
      const events = byRequest.get(requestId) ?? { types: new Set(), messages: new Set() };
      events.types.add(delivery.event!.type);
      events.messages.add(String(delivery.headers['webhook-id']));
      byRequest.set(requestId, events);
    }
    return byRequest;
  };
  while (Date.now() < deliveredBy && !ids.every((id) => [...(eventsOf().get(id)?.messages ?? [])].some((message) => delivered.has(message)))) {
    await sleep(250);
  }
  // Time for a second event of a request, were there one.
  await sleep(500);
  const events = eventsOf();
  const eventProblems = ids.flatMap((id, index) => {
    const row = rows.get(id)!;
    const of = events.get(id);
    const problem = (text: string) => [`request ${sent[index]!.i} (${row.status}): ${text}`];
    if (!of) return problem('no event');
    if (of.messages.size !== 1 || of.types.size !== 1 || !of.types.has(`request.${row.status}`)) {
      return problem(`events ${[...of.types].join(', ')} in ${of.messages.size} messages`);
    }
    if (![...of.messages].some((message) => delivered.has(message))) return problem('its event was never answered 204');
    return [];
  });
  t.same(eventProblems.slice(0, 20), [], `each request has one event, of the end it met, delivered (${eventProblems.length} problems)`);
  t.same(receiver.deliveries.filter((delivery) => delivery.verifiedWith.length === 0).length, 0, 'every delivery verified with its endpoint\'s secret');

  // Every exit was one of the kills, and a SIGTERM's a clean one.
  for (const gateway of processes) {
    const itsKills = kills.filter((kill) => kill.startsWith(`${gateway.label} `));
    t.equal(gateway.exits.length, itsKills.length, `${gateway.label} exited only when killed (${itsKills.length} times)`);
    const unclean = gateway.exits.filter((exit, n) => (itsKills[n]!.endsWith('SIGTERM') ? exit.code !== 0 : exit.signal !== 'SIGKILL'));
    t.same(unclean, [], `${gateway.label}: each SIGTERM ended in a clean exit`);
  }
  await faults.finish(t);
});
