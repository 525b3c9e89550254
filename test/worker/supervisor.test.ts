// The worker supervisor: dead pools' jobs are released, and a pool that stops on its own is
// replaced, so requests finish without a restart.
import t from 'tap';
import { sweep } from '../../src/worker/supervisor.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { isTerminal, waitForRow } from '../helpers/rows.ts';

async function lockedJobs(gateway: Awaited<ReturnType<typeof startTestGateway>>) {
  const { rows } = await gateway.pool.query(`select id, locked_by from graphile_worker._private_jobs order by id`);
  return rows as { id: string; locked_by: string | null }[];
}

t.test('the sweep releases the jobs of pools presumed dead, and only theirs', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  // Each request accepted alone adds a job that wakes its lane.
  for (let i = 0; i < 3; i++) await client.post({ model: 'm', messages: userMessage() });
  const jobs = await lockedJobs(gateway);
  t.equal(jobs.length, 3);

  // Three jobs, locked a minute ago by: a pool whose heartbeat stopped, a pool that never had
  // one (it died before its first beat), and a live pool.
  await gateway.pool.query(`
    insert into gateway.worker_pools (id, hostname, pid, last_seen_at) values
      ('pool-dead', 'h', 1, now() - interval '1 minute'),
      ('pool-live', 'h', 2, now())`);
  const lockers = ['pool-dead', 'pool-never-seen', 'pool-live'];
  for (const [index, job] of jobs.entries()) {
    await gateway.pool.query(
      `update graphile_worker._private_jobs set locked_by = $2, locked_at = now() - interval '1 minute' where id = $1`,
      [job.id, lockers[index]],
    );
  }

  const released = await sweep(gateway.db, 10_000);
  t.same(released.sort(), ['pool-dead', 'pool-never-seen']);
  t.same(
    (await lockedJobs(gateway)).map((job) => job.locked_by),
    [null, null, 'pool-live'],
    'the dead pools\' jobs are free to run again; the live pool keeps its own',
  );
  const { rows } = await gateway.pool.query('select id from gateway.worker_pools');
  t.same(rows.map((row) => row.id), ['pool-live'], 'the dead pool is forgotten');
  t.same(await sweep(gateway.db, 10_000), [], 'a second sweep finds nothing');
});

t.test('a worker pool that stops on its own is replaced, and its request completes', async (t) => {
  const gateway = await startTestGateway(t, { env: { WORKER_DEAD_AFTER_MS: '2000' } });
  const client = clientFor(gateway.url, await gateway.createKey());
  // graphile-worker stops a pool that cannot record a job's end (as when Postgres is down).
  // Make recording the end of the first job fail, once.
  await gateway.pool.query(`
    create sequence public.refusals;
    create function public.refuse_once() returns trigger language plpgsql as $$
    begin
      -- nextval is not rolled back with the failing transaction, so this refuses once only.
      if nextval('public.refusals') = 1 then
        raise exception 'simulated failure to release a job';
      end if;
      return old;
    end $$;
    create trigger refuse_once before delete on graphile_worker._private_jobs
      for each row execute function public.refuse_once();`);
  const { rows: before } = await gateway.pool.query(`select id from gateway.worker_pools where id like 'pool-%'`);
  t.equal(before.length, 1, 'one pool beating');

  const accepted = await client.post({ model: 'test-echo', messages: userMessage() });
  const row = await waitForRow(gateway.db, accepted.body.id, isTerminal, 20_000);
  t.equal(row.status, 'completed');

  // The job's end could not be recorded, so its pool stopped; a new pool took over, released the
  // job, which ran again and found its request already completed.
  for (let i = 0; (await lockedJobs(gateway)).length > 0; i++) {
    if (i > 500) throw new Error('the job was never released and finished');
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  const { rows: after } = await gateway.pool.query(`select id from gateway.worker_pools where id like 'pool-%'`);
  t.equal(after.length, 1, 'one pool beating');
  t.not(after[0].id, before[0].id, 'a new one');
  t.ok(gateway.logs.some((line) => /worker pool (stopping|stopped) on its own/.test(line)), 'the restart is logged');

  const next = await client.post({ model: 'test-echo', messages: userMessage(), wait: true });
  t.equal(next.status, 200, 'and requests keep completing');
});
