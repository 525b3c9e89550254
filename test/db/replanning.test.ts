// Plans follow the tables' growth (db/pool.ts, REPLAN_EVERY): a connection that prepared the
// claim and finish while the tables were empty, and so planned them to scan the tables whole,
// plans them again within REPLAN_EVERY statements, and then uses the indexes.
import { sql } from 'kysely';
import t, { type Test } from 'tap';
import { createDb, createPool, type Db, REPLAN_EVERY } from '../../src/db/pool.ts';
import { createLogger } from '../../src/logger.ts';
import { claimAttempts, findRequests, finishAttempts } from '../../src/requests/repository.ts';
import { createTestDatabase } from '../helpers/database.ts';

const ROWS = 20_000;
const GROUP = 8;

t.test('a group claimed and finished after the tables grew does not scan them whole', async (t) => {
  const url = await createTestDatabase(t);
  // One connection, so every statement below runs on the one whose plans were made early.
  const pool = createPool(url, { max: 1, applicationName: 'replanning-test', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  const db = createDb(pool);

  // Enough runs of small groups on empty tables for the prepared statements to settle on their
  // generic plans (and far fewer statements than REPLAN_EVERY, up to the check of those plans).
  for (let run = 0; run < 10; run++) {
    const ids = [`req_absent${String(run).padStart(20, '0')}`, `req_absent${String(run + 100).padStart(20, '0')}`];
    t.same(await claimAttempts(db, ids.map((id) => ({ id, attempt: 1, workerId: 'w' }))), [undefined, undefined]);
    t.same(
      await finishAttempts(
        db,
        ids.map((id) => ({ kind: 'completed', id, attempt: 1, result: '{}', upstreamStatus: 200, durationMs: 1 })),
      ),
      [false, false],
    );
  }

  await pool.query(`
    with project as (insert into gateway.projects (name) values ('grown') returning id),
    key as (
      insert into gateway.api_keys (id, project_id, mode, key_sha256, key_hint, signing_secret_ciphertext)
      select 'key_grownGrownGrownGrown1', id, 'test', sha256('k'), 'k', '\\x00' from project returning id, project_id
    )
    insert into gateway.requests (id, project_id, mode, api_key_id, status, model, body_sha256)
    select 'req_grown' || lpad(n::text, 20, '0'), key.project_id, 'test', key.id,
           case when n % 2 = 0 then 'queued' else 'processing' end, 'm', sha256('b')
    from key, generate_series(1, ${ROWS}) as n`);
  await pool.query(`
    update gateway.requests set attempts = 1 where status = 'processing';
    insert into gateway.request_attempts (request_id, attempt_number)
    select id, 1 from gateway.requests where status = 'processing'`);

  // What this is about: the plans made while the tables were empty scan them whole.
  const stale = await groupScans(t, db, 1);
  t.ok(stale.requests! > 0, 'before: the plans made on the empty tables scan the requests');

  // The statements that follow run on plans made again with the tables as they are now.
  for (let run = 0; run < REPLAN_EVERY; run++) await findRequests(db, ['req_absentAbsentAbsentAbsent']);

  t.same(
    await groupScans(t, db, 0),
    { requests: 0, request_attempts: 0 },
    `after: no sequential scan of the ${ROWS.toLocaleString('en-US')} requests`,
  );
});

const grown = (n: number) => `req_grown${String(n).padStart(20, '0')}`;

/**
 * Claims the queued requests of group `index` and finishes its running attempts, in one
 * transaction on the pool's one connection; returns the sequential scans of each table made.
 */
async function groupScans(t: Test, db: Db, index: number): Promise<Record<string, number>> {
  const group = Array.from({ length: GROUP }, (_, i) => index * GROUP + i + 1);
  return db.transaction().execute(async (trx) => {
    // This connection's counts not yet sent to the statistics (those of the statements above
    // among them) show in pg_stat_xact_user_tables too: what counts is the difference.
    const seqScans = async () => {
      const { rows } = await sql<{ relname: string; seq_scan: string }>`
        select relname, seq_scan from pg_stat_xact_user_tables
        where schemaname = 'gateway' and relname in ('requests', 'request_attempts')
      `.execute(trx);
      return (table: string) => Number(rows.find((row) => row.relname === table)?.seq_scan ?? 0);
    };
    const before = await seqScans();
    const claimed = await claimAttempts(
      trx,
      group.map((n) => ({ id: grown(2 * n), attempt: 1, workerId: 'w' })),
    );
    t.same(
      claimed.map((attempt) => attempt?.attempt),
      group.map(() => 1),
      'every queued request of the group was claimed',
    );
    const applied = await finishAttempts(
      trx,
      group.map((n) => ({ kind: 'completed', id: grown(2 * n - 1), attempt: 1, result: '{}', upstreamStatus: 200, durationMs: 1 })),
    );
    t.same(applied, group.map(() => true), 'every running attempt of the group was finished');
    const after = await seqScans();
    return Object.fromEntries(['requests', 'request_attempts'].map((table) => [table, after(table) - before(table)]));
  });
}
