// Lanes against an upstream that enforces limits of its own (startFakeUpstream's `limits`),
// with the same limits in UPSTREAMS_FILE, one API and two worker processes sharing a database:
// the limits hold across both workers, a burst is started no faster than the limits allow, calls held up
// on their way still find room, projects take turns, and a 429 silences the lane in both processes.
import { mkdtemp, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import t, { type Test } from 'tap';
import type { CreatedKey } from '../../src/keys/service.ts';
import { LANE_PACING } from '../../src/lanes/repository.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor } from '../helpers/http.ts';
import { spawnServe } from '../helpers/serve.ts';
import { completionAfter, rateLimited, startFakeUpstream, type FakeUpstream, type Limits, type ReceivedCall } from '../helpers/upstream.ts';
import { until, waitFor } from '../helpers/wait.ts';

interface Setup {
  api: TestGateway;
  upstream: FakeUpstream;
  /** The next call the limits let through is answered 429 with this retry-after (seconds). */
  refuseNext(retryAfterSeconds: number): void;
  key(project: string): Promise<CreatedKey>;
  /** Submits `count` wait=false requests of a project at once; resolves with their ids once all are accepted. */
  submit(key: CreatedKey, count: number, label: string): Promise<string[]>;
  /** When each request finished (ms since the epoch), once all have. */
  finished(ids: string[], timeoutMs: number): Promise<Map<string, number>>;
  /** When each of those that have finished by now finished (ms since the epoch). */
  finishedSoFar(ids: string[]): Promise<Map<string, number>>;
}

/** The upstream, an API process (in this test's process) and two worker processes, all with `limits`. */
async function setUp(t: Test, limits: Limits, delayMs: number, lateMs?: (call: ReceivedCall) => number): Promise<Setup> {
  const told: number[] = [];
  const completion = completionAfter(delayMs);
  const upstream = await startFakeUpstream(t, (call) => (told.length > 0 ? rateLimited(told.shift()!) : completion(call)), {
    limits,
    ...(lateMs ? { lateMs } : {}),
  });
  const directory = await mkdtemp(path.join(tmpdir(), 'gateway-lanes-'));
  const file = path.join(directory, 'upstreams.json');
  await writeFile(
    file,
    JSON.stringify({
      upstreams: [
        {
          name: 'limited',
          base_url: upstream.baseUrl,
          models: ['limited-*'],
          limits: {
            ...(limits.maxConcurrent ? { max_concurrent: limits.maxConcurrent } : {}),
            ...(limits.requestsPerMinute ? { requests_per_minute: limits.requestsPerMinute } : {}),
          },
        },
      ],
    }),
  );
  const api = await startTestGateway(t, { role: 'api', env: { UPSTREAMS_FILE: file } });
  const env = {
    DATABASE_URL: api.databaseUrl,
    UPSTREAMS_FILE: file,
    PORT: '0',
    HOST: '127.0.0.1',
    LOG_LEVEL: 'info',
    WORKER_POLL_INTERVAL_MS: '50',
    UPSTREAM_TIMEOUT_MS: '10000',
    RETRY_BASE_MS: '10',
    RETRY_MAX_MS: '40',
  };
  for (const worker of [spawnServe(t, env, ['--role', 'worker']), spawnServe(t, env, ['--role', 'worker'])]) {
    await until(() => worker.output().includes('worker pool started'), () => `a worker process:\n${worker.output()}`, 15_000);
  }
  /** When each of the requests `ids` that have finished by now finished (ms since the epoch). */
  const finishedSoFar = async (ids: string[]) => {
    const rows = await api.db
      .selectFrom('requests')
      .select(['id', 'finished_at'])
      .where('id', 'in', ids)
      .where('finished_at', 'is not', null)
      .execute();
    return new Map(rows.map((row) => [row.id, row.finished_at!.getTime()]));
  };
  return {
    api,
    upstream,
    refuseNext: (retryAfterSeconds) => void told.push(retryAfterSeconds),
    key: (project) => api.createKey({ project, mode: 'live' }),
    async submit(key, count, label) {
      const client = clientFor(api.url, key);
      const answers = await Promise.all(
        Array.from({ length: count }, (_, i) =>
          client.post({ model: 'limited-model', messages: [{ role: 'user', content: `${label} ${i}` }] }),
        ),
      );
      for (const answer of answers) if (answer.status !== 202) throw new Error(`not accepted: ${answer.text}`);
      return answers.map((answer) => answer.body.id as string);
    },
    async finished(ids, timeoutMs) {
      let ended = new Map<string, number>();
      if (await waitFor(async () => (ended = await finishedSoFar(ids)).size === ids.length, timeoutMs)) return ended;
      // What a reader of the failure needs, read once.
      const lanes = (await api.pool.query('select * from gateway.lanes')).rows;
      const jobs = (await api.pool.query('select id, task_identifier, run_at, locked_at, locked_by, key, attempts, last_error from graphile_worker.jobs')).rows;
      throw new Error(`timed out waiting: all ${ids.length} finished; ${ids.length - ended.size} not yet; lanes ${JSON.stringify(lanes)}; jobs ${JSON.stringify(jobs)}`);
    },
    finishedSoFar,
  };
}

async function workerIds(api: TestGateway, ids: string[]): Promise<Set<string>> {
  const rows = await api.db.selectFrom('request_attempts').select('worker_id').where('request_id', 'in', ids).execute();
  return new Set(rows.map((row) => row.worker_id!));
}

t.test('with the upstream\'s own limits configured, a burst is started at the pace they allow and never faster, and never a 429', async (t) => {
  const limits = { requestsPerMinute: 600, maxConcurrent: 4 };
  const delayMs = 200;
  const setup = await setUp(t, limits, delayMs);
  const key = await setup.key('burst');
  const ids = await setup.submit(key, 80, 'burst');
  // At its pace, some 8 s: the wait is for the burst to finish at all.
  await setup.finished(ids, 60_000);

  // 10 calls a second, 4 at once for 200 ms each (20 a second): the rate is what binds. The lane
  // is paced a little inside it (LANE_PACING): it starts its first calls at once, the rest at its
  // pace. Read from the attempts' starts (the database's clock, both workers'): in no window of
  // WINDOW_MS more than those at once and the window's pace. A slow machine only spreads them.
  const perSecond = (LANE_PACING.pace * limits.requestsPerMinute) / 60;
  const atOnce = LANE_PACING.burstSeconds * (limits.requestsPerMinute / 60);
  const WINDOW_MS = 2_000;
  // (One more: a start is stamped with its claim's transaction time, a moment before the claim
  // reads the lane's allowance.)
  const allowed = Math.floor(atOnce + (perSecond * WINDOW_MS) / 1000) + 1;
  const starts = (await setup.api.db.selectFrom('request_attempts').select('started_at').where('request_id', 'in', ids).execute())
    .map((row) => row.started_at.getTime())
    .sort((a, b) => a - b);
  const busiest = Math.max(...starts.map((start) => starts.filter((other) => other >= start && other < start + WINDOW_MS).length));
  t.ok(busiest <= allowed, `at most ${allowed} calls started in any ${WINDOW_MS} ms (${busiest})`);
  t.same(setup.upstream.refused, { rate: 0, concurrency: 0 }, 'the upstream\'s limits refused no call');
  t.same(setup.upstream.calls.filter((call) => call.status === 429), [], 'the upstream answered no 429');
  t.equal(setup.upstream.calls.length, 80, 'one call per request');
  t.ok(setup.upstream.peakInFlight() <= limits.maxConcurrent, `at most ${limits.maxConcurrent} calls at once (${setup.upstream.peakInFlight()})`);
  const rows = await setup.api.db.selectFrom('requests').select(['status', 'attempts']).where('id', 'in', ids).execute();
  t.ok(rows.every((row) => row.status === 'completed' && row.attempts === 1), 'all completed, none charged an attempt for waiting');
  t.equal((await workerIds(setup.api, ids)).size, 2, 'both worker processes ran some of them');
});

t.test('calls that reach the upstream 250 ms late, with those admitted after them, still find room within its limits', async (t) => {
  // The calls of the lane's first 100 ms are held up for 250 ms on their way (a worker's event
  // loop busy, connections being opened). The upstream's bucket, full, refills nothing meanwhile,
  // and they reach it with the calls admitted after them: the lane's first calls at once must
  // leave room for 250 ms of its pace (with 0.9 s of calls at once, a 429 came), and some to
  // spare for the machine's own delays.
  const setup = await setUp(t, { requestsPerMinute: 600 }, 200, (call) => (call.arrivedAt - setup.upstream.calls[0]!.arrivedAt < 100 ? 250 : 0));
  const ids = await setup.submit(await setup.key('late'), 40, 'late');
  await setup.finished(ids, 60_000);
  const late = setup.upstream.calls.filter((call) => call.arrivedAt - setup.upstream.calls[0]!.arrivedAt < 100).length;
  t.ok(late > 1, `the first ${late} calls were held up`);
  t.same(setup.upstream.refused, { rate: 0, concurrency: 0 }, 'the upstream\'s limits refused no call');
  t.equal(setup.upstream.calls.length, 40, 'one call per request');
});

t.test('one project\'s burst does not delay another project\'s requests behind it', async (t) => {
  const setup = await setUp(t, { maxConcurrent: 4 }, 250);
  const big = await setup.key('big');
  const small = await setup.key('small');
  const burst = await setup.submit(big, 200, 'big');
  const smallSubmitted = Date.now();
  const few = await setup.submit(small, 10, 'small');
  const smallFinished = await setup.finished(few, 30_000);
  const smallDoneAt = Math.max(...smallFinished.values());

  // 4 calls of 250 ms at once: 16 a second. Taking turns, the 10 go out within 20 calls (about
  // 1.3 s); behind the burst they would wait its 12.5 s. What shows it is the count below, of
  // the burst's calls that ran while they waited, not how long that took on this machine.
  t.comment(`the small project's 10 finished ${smallDoneAt - smallSubmitted} ms after they were sent`);
  // Counted from when the 10 were sent: on a busy machine, sending the 200 takes long enough for
  // many of them to run before. Taking turns, about 10 of the burst run while the 10 wait (and the
  // 4 under way when they came); behind it, all of the rest. Those that finished in that window
  // have all finished by now: the rest of the burst is not waited for.
  const bigFinished = await setup.finishedSoFar(burst);
  const bigWhile = [...bigFinished.values()].filter((at) => at > smallSubmitted && at <= smallDoneAt).length;
  t.ok(bigWhile < 25, `only ${bigWhile} of the burst finished while they waited`);
  t.equal(setup.upstream.refused.concurrency, 0, 'and max_concurrent held: no 429');
});

t.test('a 429 with retry-after silences the lane in both worker processes for that long', async (t) => {
  const setup = await setUp(t, { maxConcurrent: 4 }, 100);
  const key = await setup.key('paused');
  // A request every 100 ms: each wakes the lane through a job that either worker may fetch, so
  // both run the lane before the 429 and after its pause. Which worker fetches each is up to
  // them, and on a busy machine one of them may fetch a few seconds' worth: the 429 (retry-after
  // 2) comes once both have called, a second in at the earliest; then 3.5 s more of requests.
  const ids: string[] = [];
  const sending: Promise<void>[] = [];
  const send = (wave: number) => sending.push(setup.submit(key, 1, `wave ${wave}`).then(([id]) => void (ids[wave] = id!)));
  const pace = () => new Promise((resolve) => setTimeout(resolve, 100));
  // Which worker made each call: its request (by the message it carried), its attempt's worker.
  const workers = async (calls: typeof setup.upstream.calls) => {
    const attempts = await setup.api.db
      .selectFrom('request_attempts')
      .select(['request_id', 'worker_id'])
      .where('request_id', 'in', ids)
      .execute();
    const workerOf = (content: string) => {
      const id = ids[Number(/^wave (\d+) /.exec(content)![1])];
      return attempts.find((attempt) => attempt.request_id === id)!.worker_id;
    };
    return new Set(calls.map((call) => workerOf(call.content))).size;
  };
  let wave = 0;
  for (; wave < 60; wave++) {
    if (wave >= 10) {
      await Promise.all(sending);
      if ((await workers([...setup.upstream.calls])) === 2) break;
    }
    send(wave);
    await pace();
  }
  setup.refuseNext(2);
  for (const last = wave + 35; wave < last; wave++) {
    send(wave);
    await pace();
  }
  await Promise.all(sending);
  await setup.finished(ids, 30_000);
  const refused = setup.upstream.calls.find((call) => call.status === 429);
  t.ok(refused, 'the upstream answered one 429');
  const refusedAt = refused!.endedAt!;

  // Calls already under way when the 429 came may still arrive in its first moments.
  const during = setup.upstream.calls.filter((call) => call.arrivedAt > refusedAt + 150 && call.arrivedAt < refusedAt + 1_900);
  t.equal(during.length, 0, 'no call reached the upstream during the retry-after');

  const before = () => setup.upstream.calls.filter((call) => call.arrivedAt < refusedAt);
  const after = () => setup.upstream.calls.filter((call) => call.arrivedAt >= refusedAt + 1_900);
  t.equal(await workers(before()), 2, 'both workers called the upstream before the 429');
  // Likewise after its pause: a request more every 100 ms (50 at most) until both have called.
  for (const last = wave + 50; wave < last && (await workers(after())) < 2; wave++) {
    ids.push(...(await setup.submit(key, 1, `wave ${wave}`)));
    await setup.finished(ids.slice(-1), 30_000);
    await pace();
  }
  t.equal(await workers(after()), 2, 'and both after its pause');

  const rows = await setup.api.db.selectFrom('requests').select(['status', 'attempts', 'last_error_code']).where('id', 'in', ids).execute();
  t.ok(rows.every((row) => row.status === 'completed'), 'every request completed');
  t.same(rows.filter((row) => row.attempts !== 1), [{ status: 'completed', attempts: 2, last_error_code: 'upstream_rate_limited' }], 'the one that got the 429 on its retry');
});
