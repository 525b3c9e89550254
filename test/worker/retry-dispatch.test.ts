// A queue's retries share their dispatch jobs (attempts-repository.ts, RETRY_SLOT_MS): a 429 to
// each of many calls adds one job per slot of time the retries fall in, each due when its slot
// ends, not one job per retry, each of which would be fetched, run and recorded on its own.
import t from 'tap';
import { LANE_HEALTH } from '../../src/lanes/health.ts';
import { finishAttempts, RETRY_SLOT_MS, type Finish } from '../../src/worker/attempts-repository.ts';
import { testDatabasePool } from '../helpers/database.ts';
import { plantRunning } from '../helpers/populate.ts';
import { dispatchJobs } from '../helpers/rows.ts';

const SETTINGS = { maxAttempts: 5, health: LANE_HEALTH };
const REQUESTS = 40;

t.test('40 retries after 429s, due within 100 ms of each other: one dispatch job per slot they fall in, each due when its slot ends', async (t) => {
  const { pool, db } = await testDatabasePool(t, 'retry-dispatch-test');
  const ids = Array.from({ length: REQUESTS }, (_, i) => `req_retrying${String(i + 1).padStart(2, '0')}Retrying00000`);
  await plantRunning(pool, { project: 'retrying', ids });
  const retry = (id: string, index: number): Extract<Finish, { kind: 'retry' }> => ({
    kind: 'retry', id, attempt: 1, code: 'upstream_rate_limited', fault: 'rate_limited', detail: 'upstream answered HTTP 429',
    upstreamStatus: 429, durationMs: 5, delayMs: 1_000, unchargedDelayMs: 10_000 + (index % 20) * 5,
  });

  // Two statements, as two groups of finishes would come: the second finds the first's jobs.
  const first = await finishAttempts(db, ids.slice(0, 20).map(retry), SETTINGS);
  const second = await finishAttempts(db, ids.slice(20).map(retry), SETTINGS);
  t.same(
    [...first.finished, ...second.finished],
    ids.map((_, index) => ({ status: 'retrying', charged: false, retryInMs: 10_000 + (index % 20) * 5 })),
    'all retrying, none charged, each due after its uncharged backoff',
  );

  // Each retry's slot as the statement reckons it, from the time's microseconds: a Date keeps
  // milliseconds only, and a time a few microseconds past a slot's end is in the next slot.
  const { rows } = await pool.query<{ next_attempt_at: Date; due_ms: number; slot: string }>(
    `select next_attempt_at, (extract(epoch from next_attempt_at) * 1000)::float8 as due_ms,
            ceil(extract(epoch from next_attempt_at) * 1000 / $1::float8)::bigint as slot
     from gateway.requests order by id`,
    [RETRY_SLOT_MS],
  );
  const slots = new Set(rows.map((row) => Number(row.slot)));
  const jobs = await dispatchJobs(db);
  t.equal(jobs.length, slots.size, `${jobs.length} dispatch jobs for ${REQUESTS} retries: one per slot they fall in`);
  t.same(new Set(jobs.map((job) => job.run_at.getTime())), new Set([...slots].map((slot) => slot * RETRY_SLOT_MS)), 'each due when its slot ends');
  for (const [index, row] of rows.entries()) {
    const due = row.due_ms;
    const covering = jobs.filter((job) => job.run_at.getTime() >= due && job.run_at.getTime() - due < RETRY_SLOT_MS);
    if (covering.length !== 1) t.fail(`retry ${index + 1} (due ${row.next_attempt_at.toISOString()}) has ${covering.length} jobs due within a slot after it`);
  }

  // A retry due in another slot gets a job of its own.
  await pool.query(`update gateway.requests set status = 'processing', attempts = 2, next_attempt_at = null where id = $1`, [ids[0]]);
  await pool.query(`insert into gateway.request_attempts (request_id, attempt_number, worker_id, upstream) values ($1, 2, 'w', 'primary')`, [ids[0]]);
  await finishAttempts(db, [{ ...retry(ids[0]!, 0), attempt: 2, unchargedDelayMs: 60_000 }], SETTINGS);
  t.equal((await dispatchJobs(db)).length, slots.size + 1, 'a retry a minute later: one job more');
});
