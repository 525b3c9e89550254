// Keeps a worker process working through crashes and outages:
// - runs the graphile-worker pool, and starts a new one as soon as it begins to stop on its own
//   (graphile-worker stops a pool that cannot record a job's end, as happens while Postgres is
//   down, and that stop can hang for good: the new pool does not wait for it);
// - writes a heartbeat in gateway.worker_pools for its pool and for its dispatcher (the owner of
//   its attempts), which outlives pools;
// - sweeps: a worker not heard from for WORKER_DEAD_AFTER_MS is presumed dead. Its pool's jobs
//   are released with graphile_worker.force_unlock_workers, so they run again on a live worker
//   instead of after graphile-worker's 4 h, and its attempts still running are recorded as
//   worker_lost and retried, and its webhook tries under way recorded as failed and made again.
//   A process never sweeps its own current pool nor its own attempts and tries (after an outage
//   its heartbeat is stale too);
// - expires, about once a second, the requests whose deadline has passed (deadlines.ts);
// - prunes, every tenth of PRUNE_IDLE_QUEUES_AFTER (a minute at most), the queues and lanes that
//   nothing refers to and nobody has used for that long (prune.ts);
// - dispatches, every half of WORKER_DEAD_AFTER_MS, the queues with requests due that nothing is
//   going to dispatch, and wakes the webhook endpoints with messages due that nothing is going to
//   deliver (rescue.ts).
// - deletes, as often as it prunes, the graphile-worker jobs that used up their attempts, which
//   graphile-worker keeps for good (spent-jobs.ts).
// A stopping worker keeps beating for its dispatcher until its calls and webhook tries in flight
// have landed (SHUTDOWN_GRACE_MS at most), so that no other worker takes them for lost meanwhile.
import { EventEmitter } from 'node:events';
import { run, type Runner, type WorkerEvents } from 'graphile-worker';
import { Backoff } from '../client/backoff.ts';
import type { Logger } from '../logger.ts';
import { errorSummary, isDatabaseUnavailable } from '../db/pool.ts';
import { findLostAttempts } from './attempts-repository.ts';
import type { Attempts } from './attempts.ts';
import { expireOverdue } from './deadlines.ts';
import { pruneQueues } from './prune.ts';
import { rescueStranded } from './rescue.ts';
import { deleteSpent } from './spent-jobs.ts';
import type { WorkerDeps } from './runner.ts';
import { runnerOptions } from './runner.ts';
import { beat, release, sweep } from './supervisor-repository.ts';

const RESTART_MIN_MS = 250;
const RESTART_MAX_MS = 2_000;
// A pool that ran this long before stopping was healthy: the next restart is quick again.
const HEALTHY_AFTER_MS = 30_000;
// Lost attempts (and webhook tries) recorded per sweep at most; the next sweep, at once, takes the rest.
const RECOVERY_BATCH = 1_000;
// A sweep due when a heartbeat grows too old runs this much after that moment.
const SWEEP_SLACK_MS = 10;
// How often requests past their deadline are looked for: they fail within about this much of it.
const EXPIRY_INTERVAL_MS = 1_000;
// How often idle queues are looked for, at most: a queue left idle is deleted within
// PRUNE_IDLE_QUEUES_AFTER and a tenth of it (a minute, when that is shorter).
const PRUNE_INTERVAL_MAX_MS = 60_000;

export interface WorkerService {
  stop(): Promise<void>;
}

export async function startWorkerService(deps: WorkerDeps & { attempts: Attempts }): Promise<WorkerService> {
  const log = deps.logger.child({ component: 'supervisor' });
  const { dispatcher } = deps;
  const deadAfterMs = deps.config.workerDeadAfterMs;
  // Five beats per period: a live worker's row is never older than a beat plus a pause of its
  // event loop (a GC pause, a 2 s stall), far from dead-after. Sweeps come as often, and sooner
  // when the oldest heartbeat a sweep saw will be dead-after old before then: the next sweep comes
  // right at that moment. A killed worker's last beat is at most its death, so it is found dead
  // within dead-after of its death (7 s by default), and its attempts, however recent, are taken
  // with it: room under 10 s for them to start again elsewhere.
  const beatMs = Math.max(100, Math.floor(deadAfterMs / 5));

  let stopping = false;
  let current: { runner: Runner; poolId: string; startedAt: number } | undefined;
  const restartDelay = new Backoff(RESTART_MIN_MS, RESTART_MAX_MS);
  let restartTimer: NodeJS.Timeout | undefined;
  // A restart under way (launch() is waiting in graphile-worker's run()): stop() awaits it.
  let launching: Promise<void> | undefined;

  const launch = async (): Promise<void> => {
    const events: WorkerEvents = new EventEmitter();
    let poolId: string | undefined;
    events.on('pool:create', ({ workerPool }) => {
      poolId = workerPool.id;
    });
    events.on('pool:gracefulShutdown', ({ workerPool, message }) => {
      if (current?.poolId === workerPool.id) retire(current.runner, `stopping on its own: ${message}`);
    });
    const runner = await run({ ...runnerOptions(deps), events });
    if (!poolId) throw new Error('graphile-worker started without announcing its pool');
    const id = poolId;
    if (stopping) {
      // stop() came while the pool was starting, and waits for this: the pool never takes over.
      await runner.stop().catch((error: unknown) => {
        log.warn({ poolId: id, err: errorSummary(error) }, 'worker pool started during shutdown did not stop cleanly');
      });
      await release(deps.db, [id]).catch((error: unknown) => {
        log.warn({ poolId: id, err: errorSummary(error) }, 'could not release the jobs of a pool started during shutdown; the sweep will');
      });
      return;
    }
    current = { runner, poolId: id, startedAt: Date.now() };
    await beat(deps.db, [id, dispatcher.workerId]).catch((error) =>
      log.warn({ err: errorSummary(error) }, 'first heartbeat failed'),
    );
    log.info({ poolId: id }, 'worker pool started');
    const settled = (error?: unknown) => {
      retire(runner, 'stopped on its own', error);
      // A settled pool runs nothing any more: its jobs are free to run elsewhere at once. (If the
      // database is down, the sweep frees them once the pool's heartbeat is stale.)
      if (!stopping) release(deps.db, [id]).catch(() => {});
    };
    runner.promise.then(() => settled(), settled);
  };

  /** The pool is going: stop vouching for it, and start another. */
  const retire = (runner: Runner, why: string, error?: unknown) => {
    if (stopping || current?.runner !== runner) return;
    if (Date.now() - current.startedAt > HEALTHY_AFTER_MS) restartDelay.reset();
    log.error({ poolId: current.poolId, err: error && errorSummary(error) }, `worker pool ${why}; starting a new one`);
    // Its heartbeat stops with this; its attempts under way may still record their outcomes
    // until it settles or its heartbeat is WORKER_DEAD_AFTER_MS old, when its jobs are released.
    current = undefined;
    scheduleRestart();
  };

  const scheduleRestart = () => {
    if (stopping) return;
    const delay = restartDelay.next();
    restartTimer = setTimeout(() => {
      const launched: Promise<void> = launch()
        .catch((error: unknown) => {
          log.warn({ err: errorSummary(error), retryInMs: restartDelay.upcoming }, 'worker pool could not start');
          scheduleRestart();
        })
        .finally(() => {
          launching = undefined;
        });
      launching = launched;
    }, delay);
  };

  // Beats under way, awaited before the rows are released: a late one would write them back.
  const beating = new Set<Promise<void>>();
  const heartbeat = setInterval(() => {
    const ids = current ? [current.poolId, dispatcher.workerId] : [dispatcher.workerId];
    const beaten: Promise<void> = beat(deps.db, ids)
      .catch((error: unknown) => log.debug({ err: errorSummary(error) }, 'heartbeat failed'))
      .finally(() => beating.delete(beaten));
    beating.add(beaten);
  }, beatMs);
  // One sweep at a time, awaited by stop(): one must not go on with the attempts and the pool
  // after they are closed. Each schedules the next (see beatMs for when).
  let sweeping: Promise<void> | undefined;
  let sweepTimer: NodeJS.Timeout | undefined;
  const sweepNow = () => {
    // Never our own live pool nor our own attempts: our heartbeat may be stale only because the
    // database was out of reach, while our attempts are still running here.
    const live = [dispatcher.workerId, ...(current ? [current.poolId] : [])];
    let nextMs = beatMs;
    sweeping = (async () => {
      const { released, nextDeathInMs } = await sweep(deps.db, deadAfterMs, live);
      if (released.length > 0) log.warn({ workers: released }, 'released the jobs of dead workers');
      if (nextDeathInMs !== null) nextMs = Math.min(nextMs, Math.ceil(nextDeathInMs) + SWEEP_SLACK_MS);
      const lost = await findLostAttempts(deps.db, deadAfterMs, live, RECOVERY_BATCH, released);
      // Their retries, due at once, are dispatched here as the dispatcher's own are.
      const retries = lost.length > 0 ? await deps.attempts.recover(lost) : [];
      if (!stopping) for (const retry of retries) dispatcher.wakeIn(retry.queueId, retry.retryInMs);
      // Their webhook tries too: recorded as failed, and made again at once.
      const tries = await deps.deliverer.recoverLost(deadAfterMs, live, RECOVERY_BATCH, released);
      // A full batch: the rest at once.
      if (lost.length === RECOVERY_BATCH || tries === RECOVERY_BATCH) nextMs = 0;
    })()
      .catch((error: unknown) => log.debug({ err: errorSummary(error) }, 'sweep failed'))
      .finally(() => {
        sweeping = undefined;
        if (!stopping) sweepTimer = setTimeout(sweepNow, nextMs);
      });
  };
  // Requests past their deadline, queues left idle, spent jobs, queues stranded: each looked for
  // now and then, one run at a time in this process (a run that outlasts its interval, on a
  // backlog or a slow database, is not joined by another), aborted between batches by stop(), and
  // awaited.
  const idleMs = deps.config.pruneIdleQueuesAfterMs;
  const pruneMs = Math.min(PRUNE_INTERVAL_MAX_MS, Math.floor(idleMs / 10));
  const chores = [
    periodic(log, 'deadline expiry', EXPIRY_INTERVAL_MS, (signal) => expireOverdue(deps, signal)),
    periodic(log, 'pruning idle queues', pruneMs, async (signal) => {
      // Their routes are forgotten here; other processes forget theirs as they remember newer ones.
      dispatcher.forgetQueues(await pruneQueues(deps, idleMs, signal));
    }),
    // Rows nobody uses too: a spent job is never run again, and the rescue takes over what it was for.
    periodic(log, 'deleting spent jobs', pruneMs, (signal) => deleteSpent(deps, signal)),
    // A queue (or an endpoint) is taken for stranded as a worker is taken for dead: nothing heard
    // of it for WORKER_DEAD_AFTER_MS. Looked for twice per period: rescued within one and a half of it.
    periodic(log, 'rescuing stranded queues', Math.floor(deadAfterMs / 2), (signal) => rescueStranded(deps, deadAfterMs, signal)),
  ];
  const stopChores = () => Promise.all(chores.map((chore) => chore.stop()));

  try {
    await beat(deps.db, [dispatcher.workerId]);
    await launch();
    sweepNow();
  } catch (error) {
    clearInterval(heartbeat);
    await stopChores();
    throw error;
  }

  return {
    async stop() {
      stopping = true;
      clearTimeout(restartTimer);
      clearTimeout(sweepTimer);
      const choresDone = stopChores();
      // Calls in flight get SHUTDOWN_GRACE_MS to finish, then are aborted and handed back
      // (recorded as worker_lost and retried at once elsewhere); the pool's dispatches meanwhile
      // hand their lanes to other workers.
      const flightsLanded = dispatcher.stop();
      // Webhook tries alike: given the grace time, then aborted and retried at once.
      const triesLanded = deps.deliverer.stop();
      // The heartbeat goes on meanwhile: for the pool until it has stopped (its jobs are done),
      // and for the dispatcher until every call and try has landed. A pool being started by a
      // restart stops itself once it is up (launch), or is the current one by then.
      await launching;
      const pool = current;
      if (pool) {
        await pool.runner.stop().catch((error: unknown) => {
          log.warn({ poolId: pool.poolId, err: errorSummary(error) }, 'worker pool did not stop cleanly');
        });
      }
      current = undefined;
      await flightsLanded;
      await triesLanded;
      await choresDone;
      await sweeping;
      clearInterval(heartbeat);
      await Promise.all(beating);
      if (!pool) {
        await release(deps.db, [dispatcher.workerId]).catch(() => {});
        return;
      }
      const { poolId } = pool;
      // Nothing of this pool runs any more, but graphile-worker may not have given back every
      // job it held: its local queue's release can fail when jobs are waiting in it. Release
      // them now rather than after the sweep's WORKER_DEAD_AFTER_MS.
      await release(deps.db, [poolId, dispatcher.workerId]).catch((error: unknown) => {
        log.warn({ poolId, err: errorSummary(error) }, 'could not release the pool\'s jobs; the sweep will');
      });
      log.info({ poolId }, 'worker pool stopped');
    },
  };
}

/**
 * Runs `chore` every `intervalMs`, one run at a time; its failures are logged (at debug level
 * while the database is out of reach: those who wait for it log that). stop() ends the timer,
 * aborts the run under way between its batches, and resolves once it has ended.
 */
function periodic(log: Logger, what: string, intervalMs: number, chore: (signal: AbortSignal) => Promise<unknown>) {
  let running: Promise<void> | undefined;
  const stopping = new AbortController();
  const timer = setInterval(() => {
    if (running) return;
    running = chore(stopping.signal)
      .then(
        () => {},
        (error: unknown) => log[isDatabaseUnavailable(error) ? 'debug' : 'warn']({ err: errorSummary(error) }, `${what} failed`),
      )
      .finally(() => {
        running = undefined;
      });
  }, intervalMs);
  return {
    async stop(): Promise<void> {
      clearInterval(timer);
      stopping.abort();
      await running;
    },
  };
}
