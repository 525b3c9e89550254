// A worker in a process with local attempts does not fetch jobs once per lease job announced
// (worker/runner.ts): a fetch that found nothing holds the next one back. Without local
// attempts every announcement is a fetch.
import { EventEmitter } from 'node:events';
import { run, type WorkerEvents } from 'graphile-worker';
import t, { type Test } from 'tap';
import { loadConfig } from '../../src/config.ts';
import { createDb, createPool } from '../../src/db/pool.ts';
import { createLogger } from '../../src/logger.ts';
import { Metrics } from '../../src/metrics.ts';
import { createAttempts } from '../../src/worker/process-request.ts';
import { runnerOptions } from '../../src/worker/runner.ts';
import { createTestDatabase } from '../helpers/database.ts';
import { TEST_SETTINGS } from '../helpers/gateway.ts';

const ANNOUNCEMENTS = 40;

/** Fetches the worker makes while 40 lease-like jobs (due in a minute) are added 10 ms apart. */
async function fetchesWhileLeasesAreAdded(t: Test, localAttempts: boolean): Promise<number> {
  const url = await createTestDatabase(t);
  const config = loadConfig({ ...TEST_SETTINGS, LOG_LEVEL: 'silent', WORKER_POLL_INTERVAL_MS: '1000', WORKER_CONCURRENCY: '100', DATABASE_URL: url });
  const logger = createLogger(config);
  const pool = createPool(url, { max: 4, applicationName: 'gateway-worker', logger });
  t.teardown(() => pool.end());
  const db = createDb(pool);
  const metrics = new Metrics();
  const attempts = createAttempts({ db, config, metrics, logger });

  const events: WorkerEvents = new EventEmitter();
  let fetches = 0;
  events.on('localQueue:getJobs:complete', () => fetches++);
  const runner = await run({ ...runnerOptions({ config, pool, db, metrics, logger, attempts, localAttempts }), events });
  t.teardown(() => runner.stop());
  await new Promise((resolve) => setTimeout(resolve, 300)); // the first fetches, on start

  const before = fetches;
  for (let n = 0; n < ANNOUNCEMENTS; n++) {
    await pool.query(
      `select graphile_worker.add_job('process_request', json_build_object('request_id', 'req_x', 'attempt', 1),
                                      run_at => now() + interval '1 minute')`,
    );
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  await new Promise((resolve) => setTimeout(resolve, 200));
  return fetches - before;
}

t.test('with local attempts, lease jobs announced one by one do not each make a fetch', async (t) => {
  const without = await fetchesWhileLeasesAreAdded(t, false);
  const withLocal = await fetchesWhileLeasesAreAdded(t, true);
  t.comment(`fetches for ${ANNOUNCEMENTS} announcements: ${without} without local attempts, ${withLocal} with`);
  t.ok(without >= ANNOUNCEMENTS / 2, `without local attempts the announcements make fetches (${without})`);
  t.ok(withLocal <= ANNOUNCEMENTS / 4, `with local attempts most make none (${withLocal})`);
});
