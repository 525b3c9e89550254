// Fair share on a lane with tokens_per_minute (sql/000015.sql), proved at the claim itself:
// requests of two projects planted with known token estimates, gateway.claim_queue called again
// and again with the lane's allowance set before each call (and no time passing for it), and the
// requests each call started read back. Projects share the lane's tokens, not its turns; a call
// spends at most a minute of tokens_per_minute, a completion without usage keeps its estimate, and
// a call's usage moves its project's place as it corrects the lane's allowance.
// A lane without the limit keeps its turns. Either way, only the projects with a request due share
// a claim.
import { sql } from 'kysely';
import t, { type Test } from 'tap';
import { createDb, createPool, type Db } from '../../src/db/pool.ts';
import { LANE_HEALTH } from '../../src/lanes/health.ts';
import { claimQueue, ensureLanes, ensureQueue, LANE_PACING, type QueueClaim } from '../../src/lanes/repository.ts';
import { createLogger } from '../../src/logger.ts';
import { NO_LIMITS, type LaneLimits } from '../../src/upstream/upstreams.ts';
import { finishAttempts } from '../../src/worker/attempts-repository.ts';
import { createTestDatabase } from '../helpers/database.ts';

// A full allowance of 900 tokens: LANE_PACING.burstSeconds of the lane's tokens_per_minute.
const FULL = 900;
const TOKENS_PER_MINUTE = (FULL * 60) / LANE_PACING.burstSeconds;
const METERED: LaneLimits = { ...NO_LIMITS, tokensPerMinute: TOKENS_PER_MINUTE };
const LARGE = 2_000;
const SMALL = 50;

type Project = 'large' | 'small' | 'other';

interface Lane {
  db: Db;
  laneId: string;
  /** Plants `count` requests of the project, each of `tokens` estimated tokens, due in the order planted. */
  plant(project: Project, count: number, tokens: number): Promise<void>;
  /** Sets the lane's allowance to `allowance` tokens, with no time to refill it, and claims up to `max` requests. */
  claim(allowance: number, limits?: LaneLimits, max?: number): Promise<QueueClaim>;
  /** The tokens (estimates) of the requests each project has had started, and how many. */
  startedBy(ids: readonly string[]): Promise<Record<Project, { requests: number; tokens: number }>>;
  /** Requests of the project still waiting. */
  waiting(project: Project): Promise<number>;
  /** Has the project's waiting requests retried in a minute (not due until then). */
  backOff(project: Project): Promise<void>;
  /** The projects the lane keeps a fair share row for. */
  remembered(): Promise<string[]>;
}

async function lane(t: Test): Promise<Lane> {
  const pool = createPool(await createTestDatabase(t), { max: 2, applicationName: 'fair-share-test', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  const db = createDb(pool);
  await pool.query(`insert into gateway.projects (name) values ('large'), ('small'), ('other')`);
  const queueId = await ensureQueue(db, { mode: 'live', model: 'gpt-fair' });
  const [laneId] = await ensureLanes(db, { id: queueId, mode: 'live', model: 'gpt-fair' }, ['metered']);
  let planted = 0;
  return {
    db,
    laneId: laneId!,
    async plant(project, count, tokens) {
      await pool.query(
        `insert into gateway.requests (id, project_id, mode, status, model, body, body_sha256, queue_id, next_attempt_at,
                                       prompt_tokens_estimate)
         select 'req_' || $1 || lpad((n + $2)::text, 20, '0'), projects.id, 'live', 'queued', 'gpt-fair', '{}', sha256('b'),
                $3, now() - interval '1 hour' + (n + $2) * interval '1 millisecond', $4
         from gateway.projects, generate_series(1, $5::int) as n
         where projects.name = $1`,
        [project, planted, queueId, tokens, count],
      );
      planted += count;
    },
    async claim(allowance, limits = METERED, max = 100) {
      await pool.query(
        `update gateway.lanes set token_allowance = $2, refilled_at = now() + interval '1 hour' where id = $1`,
        [laneId, allowance],
      );
      return claimQueue(db, queueId, max, 'worker', [{ laneId: laneId!, limits }]);
    },
    async startedBy(ids) {
      const { rows } = await pool.query<{ name: Project; requests: number; tokens: number }>(
        `select projects.name, count(*)::int as requests, sum(requests.prompt_tokens_estimate)::int as tokens
         from gateway.requests join gateway.projects on projects.id = requests.project_id
         where requests.id = any($1)
         group by projects.name`,
        [ids],
      );
      const of = (project: Project) => {
        const row = rows.find((row) => row.name === project);
        return { requests: row?.requests ?? 0, tokens: row?.tokens ?? 0 };
      };
      return { large: of('large'), small: of('small'), other: of('other') };
    },
    async waiting(project) {
      const { rows } = await pool.query(
        `select count(*)::int as count from gateway.requests join gateway.projects on projects.id = requests.project_id
         where projects.name = $1 and requests.status = 'queued'`,
        [project],
      );
      return rows[0].count;
    },
    async backOff(project) {
      await pool.query(
        `update gateway.requests set status = 'retrying', attempts = 1, next_attempt_at = now() + interval '1 minute'
         from gateway.projects
         where projects.id = requests.project_id and projects.name = $1 and requests.status = 'queued'`,
        [project],
      );
    },
    async remembered() {
      const { rows } = await pool.query<{ name: string }>(
        `select projects.name from gateway.lane_fair_shares as shares join gateway.projects on projects.id = shares.project_id
         where shares.lane_id = $1 order by projects.name`,
        [laneId],
      );
      return rows.map((row) => row.name);
    },
  };
}

const ids = (claim: QueueClaim) => claim.started.map((started) => started.id);

t.test('both projects waiting: each gets an equal share of the lane\'s tokens, the small prompts many times the requests', async (t) => {
  const fair = await lane(t);
  await fair.plant('large', 100, LARGE);
  await fair.plant('small', 3_000, SMALL);
  const started: string[] = [];
  for (let claim = 0; claim < 60; claim++) started.push(...ids(await fair.claim(FULL)));
  t.ok((await fair.waiting('large')) > 0 && (await fair.waiting('small')) > 0, 'both still had requests waiting throughout');
  const { large, small } = await fair.startedBy(started);
  // Start-time fair queueing keeps two backlogged projects within one request of each other, plus
  // the part of a claim that ends it.
  t.ok(
    Math.abs(large.tokens - small.tokens) <= LARGE + FULL,
    `large: ${large.tokens} tokens in ${large.requests} requests; small: ${small.tokens} tokens in ${small.requests} requests`,
  );
  t.ok(small.requests >= 30 * large.requests, `the small project started ${small.requests} requests to the large one's ${large.requests}`);
});

t.test('small requests arriving behind a backlog of large ones start ahead of the next large one', async (t) => {
  const fair = await lane(t);
  await fair.plant('large', 20, LARGE);
  for (let claim = 0; claim < 5; claim++) t.equal((await fair.claim(FULL)).started.length, 1, 'the large project alone: one a claim');
  await fair.plant('small', 10, SMALL);
  // 500 tokens: the ten small ones (450 before the tenth) fit, and the large project's next
  // would only start after them.
  const next = await fair.claim(500);
  const { large, small } = await fair.startedBy(ids(next));
  t.same({ large, small }, { large: { requests: 0, tokens: 0 }, small: { requests: 10, tokens: 500 } },
    'all ten small requests start in the first claim after they arrive, and no large one');
  const after = await fair.claim(FULL);
  t.same((await fair.startedBy(ids(after))).large, { requests: 1, tokens: LARGE }, 'then the large project\'s next');
});

t.test('a stream of small requests does not starve the large project: it starts one each time the other has spent as much', async (t) => {
  const fair = await lane(t);
  await fair.plant('large', 5, LARGE);
  await fair.plant('small', 2_000, SMALL);
  const startedAt: number[] = [];
  for (let claim = 0; claim < 20; claim++) {
    const { large } = await fair.startedBy(ids(await fair.claim(FULL)));
    for (let i = 0; i < large.requests; i++) startedAt.push(claim);
  }
  t.equal(startedAt.length, 5, `all five large requests started within 20 claims (at claims ${startedAt.join(', ')})`);
  t.ok((await fair.waiting('small')) > 0, 'while the small project still had requests waiting');
  // 2,000 tokens of small requests between two large ones take two to three claims of 900.
  for (let i = 1; i < startedAt.length; i++) {
    t.ok(startedAt[i]! - startedAt[i - 1]! <= 4, `large request ${i + 1} started ${startedAt[i]! - startedAt[i - 1]!} claims after the one before`);
  }
});

t.test('a call spends at most a minute of tokens_per_minute, when it starts and when its usage is known', async (t) => {
  const fair = await lane(t);
  // Accepted while a deployment allowed 10,000 tokens a minute; the lane now allows 3,000.
  await fair.plant('large', 2, 10_000);
  const shrunk: LaneLimits = { ...NO_LIMITS, tokensPerMinute: 3_000 };
  const full = (LANE_PACING.burstSeconds * 3_000) / 60;
  const first = await fair.claim(full, shrunk);
  t.equal(first.started.length, 1);
  const allowance = async () => {
    const row = await fair.db.selectFrom('lanes').select('token_allowance').where('id', '=', fair.laneId).executeTakeFirstOrThrow();
    return row.token_allowance!;
  };
  t.equal(await allowance(), full - 3_000, 'the lane is charged 3,000 tokens, not 10,000');
  // 3,000 tokens at 95 % of 3,000 a minute: about 63 s.
  t.ok(first.roomInMs !== undefined && first.roomInMs <= 64_000, `the lane has room again within about a minute (in ${first.roomInMs} ms)`);

  const [completed] = await finishAttempts(
    fair.db,
    [{ kind: 'completed', id: first.started[0]!.id, attempt: 1, laneId: fair.laneId, result: '{}', usage: { prompt: 10_500, completion: 1_500, total: 12_000 }, upstreamStatus: 200, durationMs: 1 }],
    { maxAttempts: 5, health: LANE_HEALTH },
  ).then((result) => result.finished);
  t.match(completed, { status: 'completed' });
  t.equal(await allowance(), full - 3_000, 'its usage of 12,000 tokens is counted as 3,000 too');

  const second = await fair.claim(1, shrunk);
  t.equal(second.started.length, 1);
  t.equal(await allowance(), 1 - 3_000);
  await finishAttempts(
    fair.db,
    [{ kind: 'failed', id: second.started[0]!.id, attempt: 1, code: 'upstream_bad_request', fault: 'request', detail: 'too long', upstreamStatus: 400, durationMs: 1 }],
    { maxAttempts: 5, health: LANE_HEALTH },
  );
  t.equal(await allowance(), 1, 'a call that ends without a completion gives back the 3,000 it was charged, not 10,000');
});

t.test('a completion without usage keeps the estimate it was charged; an attempt that ends without one gives it back', async (t) => {
  const fair = await lane(t);
  await fair.plant('large', 3, 400);
  const allowance = async () => {
    const row = await fair.db.selectFrom('lanes').select('token_allowance').where('id', '=', fair.laneId).executeTakeFirstOrThrow();
    return row.token_allowance!;
  };
  const claim = await fair.claim(FULL);
  t.equal(claim.started.length, 3);
  t.equal(await allowance(), FULL - 1_200);
  const [completed, failed, retried] = claim.started;
  // An OpenAI-compatible server that leaves usage out still served the prompt.
  await finishAttempts(
    fair.db,
    [{ kind: 'completed', id: completed!.id, attempt: 1, laneId: fair.laneId, result: '{}', usage: { prompt: null, completion: null, total: null }, upstreamStatus: 200, durationMs: 1 }],
    { maxAttempts: 5, health: LANE_HEALTH },
  );
  t.equal(await allowance(), FULL - 1_200, 'the completion keeps its 400 tokens');
  await finishAttempts(
    fair.db,
    [
      { kind: 'failed', id: failed!.id, attempt: 1, code: 'upstream_bad_request', fault: 'request', detail: 'too long', upstreamStatus: 400, durationMs: 1 },
      { kind: 'retry', id: retried!.id, attempt: 1, code: 'upstream_server_error', fault: 'upstream', detail: '500', upstreamStatus: 500, durationMs: 1, delayMs: 1_000, unchargedDelayMs: 1_000 },
    ],
    { maxAttempts: 5, health: LANE_HEALTH },
  );
  t.equal(await allowance(), FULL - 400, 'the failure and the retry give back their 400 each');
});

t.test('a project\'s place follows the tokens its calls used: usage below the estimate moves it back, above it moves it on', async (t) => {
  const usedBy = async (fair: Lane, estimate: number, total: number) => {
    await fair.plant('large', 1, estimate);
    const [started] = (await fair.claim(FULL)).started;
    await finishAttempts(
      fair.db,
      [{ kind: 'completed', id: started!.id, attempt: 1, laneId: fair.laneId, result: '{}', usage: { prompt: total - 10, completion: 10, total }, upstreamStatus: 200, durationMs: 1 }],
      { maxAttempts: 5, health: LANE_HEALTH },
    );
    await fair.plant('large', 10, SMALL);
    await fair.plant('small', 10, SMALL);
    // 500 tokens: ten small requests, in the order of their starts.
    const { large, small } = await fair.startedBy(ids(await fair.claim(500)));
    return [large.requests, small.requests];
  };
  // Estimated at 2,000 (0 to 2,000 on the clock, which stays at 0), used 100: the large project's
  // next start at 100, two small requests behind the other's first (0 and 50), then one each.
  t.same(await usedBy(await lane(t), LARGE, 100), [4, 6], 'a call that used 100 of its 2,000 tokens: the next claim is shared');
  // Estimated at 400, used 2,400: the large project's next start at 2,400, beyond the ten.
  t.same(await usedBy(await lane(t), 400, 2_400), [0, 10], 'a call that used 2,400 tokens, not 400: the other project\'s ten go first');
});

t.test('a call whose project the clock passed while it ran (its row forgotten) still moves it on by what it used above its estimate', async (t) => {
  const fair = await lane(t);
  await fair.plant('large', 1, 400);
  await fair.plant('small', 20, SMALL);
  // One claim starts the large request (0 to 400) and ten small ones (0 to 500): the clock passes
  // the large project's next start, and the lane forgets it (level with the clock).
  const first = await fair.claim(FULL);
  t.same(await fair.startedBy(ids(first)), { large: { requests: 1, tokens: 400 }, small: { requests: 10, tokens: 500 }, other: { requests: 0, tokens: 0 } });
  t.same(await fair.remembered(), ['small'], 'the large project is level with the clock');
  const [large] = first.started.filter((started) => started.id.startsWith('req_large'));
  await finishAttempts(
    fair.db,
    [{ kind: 'completed', id: large!.id, attempt: 1, laneId: fair.laneId, result: '{}', usage: { prompt: 390, completion: 2_010, total: 2_400 }, upstreamStatus: 200, durationMs: 1 }],
    { maxAttempts: 5, health: LANE_HEALTH },
  );
  t.same(await fair.remembered(), ['large', 'small'], 'its 2,000 tokens over the estimate put it ahead of the clock again');
  await fair.plant('large', 10, SMALL);
  const { large: next, small } = await fair.startedBy(ids(await fair.claim(500)));
  t.same([next.requests, small.requests], [0, 10], 'the other project\'s ten go first');
});

t.test('the lane remembers only projects ahead of its clock, and forgets one idle for a minute', async (t) => {
  const fair = await lane(t);
  await fair.plant('large', 10, LARGE);
  await fair.plant('small', 4, SMALL);
  // Both start at 0: the first small request (to 50), then the first large one (to 2,000).
  await fair.claim(FULL);
  t.same(await fair.remembered(), ['large', 'small'], 'both are ahead of the clock (still at 0)');
  // The other three small ones (50 to 200), then the large project's second (2,000 to 4,000).
  await fair.claim(FULL);
  t.same(await fair.remembered(), ['large'], 'the clock moved to 2,000: the small project, at 200, needs no row');
  await fair.plant('small', 1, SMALL);
  t.equal((await fair.claim(SMALL)).started.length, 1, 'the small one alone (2,000 to 2,050)');
  t.same(await fair.remembered(), ['large', 'small']);

  await fair.db.updateTable('lane_fair_shares').set({ started_at: sql<Date>`now() - interval '2 minutes'` }).execute();
  await fair.plant('other', 1, SMALL);
  // Another project, at the clock (2,000 to 2,050): the clock stays behind the small project's 2,050.
  t.same((await fair.startedBy(ids(await fair.claim(SMALL)))).other, { requests: 1, tokens: SMALL });
  t.same(await fair.remembered(), ['large', 'other'],
    'a minute on, the row of the small project, with nothing waiting, is gone; the large one, waiting, keeps its own');
});

t.test('a lane without tokens_per_minute keeps its turns: one request each, whatever their size', async (t) => {
  const fair = await lane(t);
  await fair.plant('large', 10, LARGE);
  await fair.plant('small', 10, SMALL);
  const claim = await fair.claim(0, NO_LIMITS, 6);
  const { large, small } = await fair.startedBy(ids(claim));
  t.same([large.requests, small.requests], [3, 3], 'three each');
  const { rows } = await sql<{ count: number }>`select count(*)::int as count from gateway.lane_fair_shares`.execute(fair.db);
  t.equal(rows[0]!.count, 0, 'and keeps no token shares');
});

t.test('projects whose requests all wait for a retry later take no share of a claim, with tokens_per_minute or without', async (t) => {
  for (const limits of [METERED, NO_LIMITS]) {
    const fair = await lane(t);
    await fair.plant('large', 5, LARGE);
    await fair.plant('other', 5, SMALL);
    await fair.backOff('large');
    await fair.backOff('other');
    await fair.plant('small', 20, SMALL);
    // Shared among three projects, 9 would be 3 each.
    const claim = await fair.claim(FULL, limits, 9);
    const { large, small, other } = await fair.startedBy(ids(claim));
    t.same([small.requests, large.requests, other.requests], [9, 0, 0],
      `${limits.tokensPerMinute ? 'tokens_per_minute' : 'no limit'}: the one project with requests due starts all 9`);
  }
});
