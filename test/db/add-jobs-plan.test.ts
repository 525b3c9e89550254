// graphile-worker's add_jobs keeps its cached plans on indexes (db/migrate.ts): a connection
// whose plans were made while the queue was empty does not scan the whole jobs table once the
// queue has grown.
import pg from 'pg';
import t from 'tap';
import { createTestDatabase } from '../helpers/database.ts';

const oneJob = `select count(*) from graphile_worker.add_jobs(array[
  row('process_request', '{}'::json, null, now() + interval '1 hour', null, null, null, null)::graphile_worker.job_spec
])`;

t.test('adding a job after the queue grew does not scan the whole jobs table', async (t) => {
  const url = await createTestDatabase(t);
  const accepting = new pg.Client({ connectionString: url });
  const other = new pg.Client({ connectionString: url });
  await accepting.connect();
  await other.connect();
  t.teardown(() => Promise.all([accepting.end(), other.end()]));

  // Enough calls on an empty queue for PL/pgSQL to settle on its generic plans.
  for (let call = 0; call < 10; call++) await accepting.query(oneJob);

  await other.query(`select count(*) from graphile_worker.add_jobs(array(
    select row('process_request', json_build_object('n', n), null, now() + interval '1 hour',
               null, null, null, null)::graphile_worker.job_spec
    from generate_series(1, 20000) as n))`);

  await accepting.query('begin');
  await accepting.query(oneJob);
  const { rows } = await accepting.query<{ seq_scan: string }>(
    `select seq_scan from pg_stat_xact_user_tables where relid = 'graphile_worker._private_jobs'::regclass`,
  );
  await accepting.query('commit');
  t.equal(Number(rows[0]!.seq_scan), 0, 'no sequential scan of the 20,010 jobs');

  const { rows: count } = await other.query<{ count: string }>('select count(*) from graphile_worker.jobs');
  t.equal(Number(count[0]!.count), 20_011, 'every job was added');
});
