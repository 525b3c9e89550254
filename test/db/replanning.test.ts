// Plans follow the tables' growth (db/pool.ts, REPLAN_EVERY): a connection that planned the
// claim (gateway.claim_queue's statements) and the finish while the tables were nearly empty, and
// so planned them to read every row of the group's table, plans them again within REPLAN_EVERY
// statements, and then reads only the group's rows, through the indexes.
import { sql } from 'kysely';
import type pg from 'pg';
import t, { type Test } from 'tap';
import { type Db, REPLAN_EVERY } from '../../src/db/pool.ts';
import { LANE_HEALTH } from '../../src/lanes/health.ts';
import { claimQueue } from '../../src/lanes/repository.ts';
import { findRequests } from '../../src/requests/read-repository.ts';
import { NO_LIMITS } from '../../src/upstream/upstreams.ts';
import { finishAttempts } from '../../src/worker/attempts-repository.ts';
import { testDatabasePool } from '../helpers/database.ts';

const ROWS = 20_000;
const GROUP = 8;

t.test('a group claimed and finished after the tables grew does not scan them whole', async (t) => {
  // One connection, so every statement below runs on the one whose plans were made early.
  const { pool, db } = await testDatabasePool(t, 'replanning-test', 1);
  // Plans are made again when a table they read is analyzed: autovacuum doing so during the test
  // (it visits a new database's tables soon after it is created) would replace the early plans
  // before they are checked. Off for every table the statements read. (So would a reset of the
  // backend's caches, which other databases' catalog changes can cause: the suite runs this file
  // alone, in tap.serial.)
  const { rows: tables } = await pool.query<{ name: string }>(
    `select format('%I.%I', schemaname, tablename) as name from pg_tables where schemaname in ('gateway', 'graphile_worker')`,
  );
  for (const { name } of tables) await pool.query(`alter table ${name} set (autovacuum_enabled = false)`);

  await pool.query(`
    with project as (insert into gateway.projects (name) values ('grown') returning id),
    key as (
      insert into gateway.api_keys (id, project_id, mode, key_sha256, key_hint, signing_secret_ciphertext)
      select 'key_grownGrownGrownGrown1', id, 'test', sha256('k'), 'k', '\\x00' from project returning id, project_id
    )
    , queue as (insert into gateway.queues (mode, model) values ('test', '*') returning id)
    insert into gateway.lanes (mode, upstream, model, queue_id) select 'test', 'simulator', '*', id from queue`);

  // Enough runs of small groups on nearly empty tables for the statements to settle on their
  // generic plans (and far fewer statements than REPLAN_EVERY, up to the check of those plans).
  for (let run = 0; run < 10; run++) {
    await plant(pool, `req_early${String(run).padStart(20, '0')}`, 'queued');
    const claim = await claimQueue(db, QUEUE, 2, 'w', DEPLOYMENTS);
    t.equal(claim.started.length, 1, 'the one queued request is claimed');
    t.same(
      await finishAttempts(
        db,
        claim.started.map((started) => ({ kind: 'completed', id: started.id, attempt: 1, laneId: started.laneId, result: '{}', usage: NO_USAGE, upstreamStatus: 200, durationMs: 1 })),
        SETTINGS,
      ).then(applied),
      [true],
    );
    const absent = [`req_absent${String(run).padStart(20, '0')}`, `req_absent${String(run + 100).padStart(20, '0')}`];
    t.same(
      await finishAttempts(
        db,
        absent.map((id) => ({ kind: 'completed', id, attempt: 1, laneId: LANE, result: '{}', usage: NO_USAGE, upstreamStatus: 200, durationMs: 1 })),
        SETTINGS,
      ).then(applied),
      [false, false],
    );
  }

  await pool.query(`
    insert into gateway.requests (id, project_id, mode, api_key_id, status, model, body, body_sha256, queue_id, lane_id, next_attempt_at)
    select 'req_grown' || lpad(n::text, 20, '0'), keys.project_id, 'test', keys.id,
           case when n % 2 = 0 then 'queued' else 'processing' end, 'm', '{}', sha256('b'), ${QUEUE},
           case when n % 2 = 0 then null else ${LANE} end,
           case when n % 2 = 0 then now() - interval '1 hour' end
    from gateway.api_keys as keys, generate_series(1, ${ROWS}) as n`);
  await pool.query(`
    update gateway.requests set attempts = 1 where status = 'processing';
    insert into gateway.request_attempts (request_id, attempt_number)
    select id, 1 from gateway.requests where status = 'processing'`);

  // What this is about: the plans made while the tables were nearly empty join a group to every
  // row they hold (the claim's picks to the lane's queue, the finish's outcomes to the running requests).
  const stale = await groupScans(t, db, 1);
  t.ok(stale.requestsRead > ROWS / 2, `before: the plans made early read ${stale.requestsRead} rows of requests for a group of ${GROUP}`);

  // The statements that follow run on plans made again with the tables as they are now.
  for (let run = 0; run < REPLAN_EVERY; run++) await findRequests(db, ['req_absentAbsentAbsentAbsent']);

  const fresh = await groupScans(t, db, 0);
  t.same(fresh.scans, { requests: 0, request_attempts: 0 }, `after: no sequential scan of the ${ROWS.toLocaleString('en-US')} requests`);
  t.ok(fresh.requestsRead < 200, `and ${fresh.requestsRead} rows of requests read for the group, not the whole queue`);
});

const QUEUE = '1';
const LANE = '1';
const DEPLOYMENTS = [{ laneId: LANE, limits: NO_LIMITS }];
const SETTINGS = { maxAttempts: 5, health: LANE_HEALTH };
const applied = (result: { finished: unknown[] }) => result.finished.map((finished) => finished !== null);
const NO_USAGE = { prompt: null, completion: null, total: null };
const grown = (n: number) => `req_grown${String(n).padStart(20, '0')}`;

async function plant(pool: pg.Pool, id: string, status: 'queued'): Promise<void> {
  await pool.query(
    `insert into gateway.requests (id, project_id, mode, api_key_id, status, model, body, body_sha256, queue_id, next_attempt_at)
     select $1, project_id, 'test', id, $2, 'm', '{}', sha256('b'), ${QUEUE}, now() from gateway.api_keys`,
    [id, status],
  );
}

/**
 * Claims GROUP queued requests and finishes the running attempts of group `index`, in one
 * transaction on the pool's one connection; returns the sequential scans of each table made, and
 * the rows of requests read.
 */
async function groupScans(t: Test, db: Db, index: number): Promise<{ scans: Record<string, number>; requestsRead: number }> {
  const group = Array.from({ length: GROUP }, (_, i) => index * GROUP + i + 1);
  return db.transaction().execute(async (trx) => {
    // This connection's counts not yet sent to the statistics (those of the statements above
    // among them) show in pg_stat_xact_user_tables too: what counts is the difference.
    const seqScans = async () => {
      const { rows } = await sql<{ relname: string; seq_scan: string; tuples_read: string }>`
        select relname, seq_scan, seq_tup_read + coalesce(idx_tup_fetch, 0) as tuples_read from pg_stat_xact_user_tables
        where schemaname = 'gateway' and relname in ('requests', 'request_attempts')
      `.execute(trx);
      const of = (table: string) => rows.find((row) => row.relname === table);
      return Object.assign((table: string) => Number(of(table)?.seq_scan ?? 0), { read: (table: string) => Number(of(table)?.tuples_read ?? 0) });
    };
    const before = await seqScans();
    const claim = await claimQueue(trx, QUEUE, GROUP, 'w', DEPLOYMENTS);

    t.same(
      claim.started.map((attempt) => attempt.attempt),
      group.map(() => 1),
      'a group of queued requests was claimed',
    );
    const finished = await finishAttempts(
      trx,
      group.map((n) => ({ kind: 'completed', id: grown(2 * n - 1), attempt: 1, laneId: LANE, result: '{}', usage: NO_USAGE, upstreamStatus: 200, durationMs: 1 })),
      SETTINGS,
    );
    t.same(applied(finished), group.map(() => true), 'every running attempt of the group was finished');
    const after = await seqScans();
    return {
      scans: Object.fromEntries(['requests', 'request_attempts'].map((table) => [table, after(table) - before(table)])),
      requestsRead: after.read('requests') - before.read('requests'),
    };
  });
}
