// Completions are recorded in fewer steps when their lanes have nothing to learn from them
// (attempts-repository.ts, finishCompletions); a lane that has (a failure streak, an open window
// of failures, a token allowance) learns from them as from any other group.
import type pg from 'pg';
import t, { type Test } from 'tap';
import { LANE_HEALTH } from '../../src/lanes/health.ts';
import { finishAttempts, type Finish } from '../../src/worker/attempts-repository.ts';
import { testDatabasePool } from '../helpers/database.ts';
import { plantRunning } from '../helpers/populate.ts';

const SETTINGS = { maxAttempts: 5, health: LANE_HEALTH };
const USAGE = { prompt: 60, completion: 20, total: 80 };

async function setUp(t: Test, lane: string) {
  const { pool, db } = await testDatabasePool(t, 'finish-completions-test');
  const ids = [1, 2].map((n) => `req_finishing${n}Finishing0000`);
  const { laneId } = await plantRunning(pool, { project: 'finishing', ids, promptTokensEstimate: 50 });
  await pool.query(`update gateway.lanes set ${lane}`);
  const completions: Finish[] = ids.map((id) => ({
    kind: 'completed', id, attempt: 1, laneId, result: '{"object":"chat.completion"}',
    usage: USAGE, upstreamStatus: 200, durationMs: 5,
  }));
  return { pool, db, completions };
}

const laneRow = async (pool: pg.Pool) => (await pool.query('select * from gateway.lanes')).rows[0] as Record<string, unknown>;
const requestRows = async (pool: pg.Pool) =>
  (await pool.query(`select requests.status, requests.total_tokens, requests.result_bytes, requests.charged_attempts, request_attempts.outcome, request_attempts.charged
                     from gateway.requests join gateway.request_attempts on request_attempts.request_id = requests.id order by requests.id`)).rows;
// (result_bytes: the size of '{"object":"chat.completion"}'.)
const RECORDED = [1, 2].map(() => ({ status: 'completed', total_tokens: 80, result_bytes: 28, charged_attempts: 0, outcome: 'succeeded', charged: null }));

t.test('completions on a lane with nothing to learn: their rows written, the lane left as it was', async (t) => {
  const { pool, db, completions } = await setUp(t, `health = 'healthy'`);
  const before = await laneRow(pool);
  const result = await finishAttempts(db, completions, SETTINGS);
  t.same(result, { finished: [1, 2].map(() => ({ status: 'completed', charged: null })), laneChanges: [] });
  t.same(await requestRows(pool), RECORDED, 'completed, with their usage, and their attempts succeeded');
  t.same(await laneRow(pool), before, 'the lane row is unchanged');
  t.same((await finishAttempts(db, completions, SETTINGS)).finished, [null, null], 'a second report of the same attempts changes nothing');
});

t.test('completions on a lane with a failure streak and a window of failures open reset the streak and count in the window', async (t) => {
  const { pool, db, completions } = await setUp(
    t,
    `failure_streak = 3, last_failed_request_id = 'req_otherOtherOtherOther01', window_started_at = now(), window_calls = 4, window_failures = 3`,
  );
  await finishAttempts(db, completions, SETTINGS);
  t.same(await requestRows(pool), RECORDED);
  t.match(await laneRow(pool), { health: 'healthy', failure_streak: 0, last_failed_request_id: null, window_calls: 6, window_failures: 3 });
});

t.test('completions on a token-limited lane correct its allowance from the estimate to the usage', async (t) => {
  const { pool, db, completions } = await setUp(t, `tokens_per_minute = 10000, token_allowance = 1000`);
  await finishAttempts(db, completions, SETTINGS);
  t.same(await requestRows(pool), RECORDED);
  // Each used 80 tokens where 50 were estimated: 30 more each.
  t.equal(Number((await laneRow(pool)).token_allowance), 940);
});

t.test('a completion on an open lane (its probe) closes it', async (t) => {
  const { pool, db, completions } = await setUp(
    t,
    `health = 'probing', health_since = now() - interval '1 minute', probe_request_id = 'req_finishing1Finishing0000', probe_interval_ms = 2000`,
  );
  const result = await finishAttempts(db, completions.slice(0, 1), SETTINGS);
  t.match(result.laneChanges, [{ from: 'probing', to: 'healthy' }]);
  t.match(await laneRow(pool), { health: 'healthy', probe_request_id: null });
});
