// Running one attempt of a request: claim it (queued|retrying -> processing, one attempt row
// more), call the upstream or the simulator with no database connection held, then record the
// outcome: completed, failed, or retrying with the next attempt's job added in the same
// statement. The graphile-worker task below runs the attempts that jobs name; local attempts
// (worker/local-attempts.ts) run those a wait=true request started as it was stored.
// Claims and outcomes of concurrent tasks are written in groups (db/batcher.ts): one statement
// and one commit for all the attempts that start, or end, at about the same time.
// A job whose attempt was already started is one whose worker died mid-attempt (its lock was
// released by the dead-worker sweep, or the lease job of a local attempt came due): that
// attempt is recorded as worker_lost and retried. So is
// an attempt cut short by a shutdown after SHUTDOWN_GRACE_MS. Every statement rides out a short
// database outage, so an answer already paid for is not thrown away.
import type { JobHelpers, Task } from 'graphile-worker';
import * as v from 'valibot';
import type { Config } from '../config.ts';
import { Batcher, writeFirsts } from '../db/batcher.ts';
import { errorSummary, type Db } from '../db/pool.ts';
import { whileUnavailable } from '../db/retry.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { ProcessRequestPayload } from '../requests/jobs.ts';
import * as repository from '../requests/repository.ts';
import type { AttemptFailure, Claim, ClaimedAttempt, Finish } from '../requests/repository.ts';
import { callOpenAiCompatible } from '../upstream/openai.ts';
import { ATTEMPT_ERRORS, type AttemptOutcome } from '../upstream/outcome.ts';
import { simulate } from '../upstream/simulator.ts';
import { retryDelay } from './backoff.ts';

export interface AttemptDeps {
  db: Db;
  config: Pick<
    Config,
    'upstreamBaseUrl' | 'upstreamApiKey' | 'upstreamTimeoutMs' | 'maxAttempts' | 'retryBaseMs' | 'retryMaxMs'
  >;
  metrics: Metrics;
  logger: Logger;
  /** Called after a request reached completed or failed, to wake waiters in this process. */
  onFinished?: (id: string) => void;
}

/** What became of a request once its attempt was recorded; stale: another worker had taken it over. */
export type Recorded =
  | { status: 'completed'; result: string }
  | { status: 'failed' | 'retrying' | 'stale' };

/** Starting, running and recording attempts: shared by the queue's task and local attempts. */
export interface Attempts {
  /** Starts the attempt a job names; undefined when the request was not waiting for it. */
  claim(claim: Claim): Promise<ClaimedAttempt | undefined>;
  /**
   * Calls the upstream (or the simulator) with no database connection held, then records the
   * outcome; `signal` aborts the call (a shutdown), which is recorded as worker_lost.
   */
  run(claimed: ClaimedAttempt, signal: AbortSignal, leaseJobId?: string): Promise<Recorded>;
  /** A job found its attempt already started: if that attempt is still open, it was lost. */
  recoverLostAttempt(id: string, attempt: number): Promise<void>;
}

// How long a statement is retried while the database is unreachable.
const OUTAGE_PATIENCE_MS = 60_000;
// Claim and finish statements under way at once (each holds a connection while it runs).
const GROUP_STATEMENTS_IN_FLIGHT = 2;

export function createAttempts(deps: AttemptDeps): Attempts {
  const log = deps.logger.child({ component: 'worker' });
  const groups = { maxInFlight: GROUP_STATEMENTS_IN_FLIGHT, maxBatch: 500 };
  const claims = new Batcher<Claim, ClaimedAttempt | undefined>((items) => claimGroup(deps.db, items), groups);
  const finishes = new Batcher<Finish, boolean>((items) => repository.finishAttempts(deps.db, items), groups);
  const db = <T>(statement: () => Promise<T>) =>
    whileUnavailable(statement, {
      maxWaitMs: OUTAGE_PATIENCE_MS,
      onRetry: (error, delayMs) => log.warn({ err: errorSummary(error), delayMs }, 'database unreachable; retrying'),
    });

  return {
    claim: (claim) => db(() => claims.submit(claim)),

    async run(claimed, signal, leaseJobId) {
      const started = performance.now();
      let outcome = await callUpstream(claimed, signal);
      const durationMs = Math.round(performance.now() - started);
      if (!outcome.ok && signal.aborted) {
        outcome = {
          ok: false,
          code: 'worker_lost',
          detail: 'the worker shut down before the upstream answered',
          upstreamStatus: null,
        };
      }
      const result = outcome.ok ? 'succeeded' : 'failed';
      deps.metrics.attempts.inc({ mode: claimed.mode, outcome: result, code: outcome.ok ? 'none' : outcome.code });
      deps.metrics.upstreamDuration.observe({ mode: claimed.mode, outcome: result }, durationMs / 1000);
      return record(claimed.id, claimed.attempt, outcome, durationMs, leaseJobId);
    },

    async recoverLostAttempt(id, attempt) {
      const progress = await db(() => repository.findProgress(deps.db, id));
      // Terminal, already past this attempt, or gone: this job has nothing left to do.
      if (progress?.status !== 'processing' || progress.attempts !== attempt) return;
      log.warn({ requestId: id, attempt }, 'attempt lost with its worker; recording it and retrying');
      deps.metrics.attempts.inc({ mode: progress.mode, outcome: 'failed', code: 'worker_lost' });
      await fail(id, attempt, {
        code: 'worker_lost',
        detail: 'the worker running this attempt stopped before recording its outcome',
        upstreamStatus: null,
        durationMs: null,
      });
    },
  };

  async function callUpstream(claimed: ClaimedAttempt, abort: AbortSignal): Promise<AttemptOutcome> {
    const signal = AbortSignal.any([AbortSignal.timeout(deps.config.upstreamTimeoutMs), abort]);
    const call = { body: claimed.body, signal };
    try {
      return claimed.mode === 'test'
        ? await simulate({ ...call, attempt: claimed.attempt })
        : await callOpenAiCompatible({ baseUrl: deps.config.upstreamBaseUrl, apiKey: deps.config.upstreamApiKey }, call);
    } catch (error) {
      // The callers classify every failure they know; anything else is a bug on our side,
      // recorded as an invalid response so the request still ends (after its retries).
      log.error({ requestId: claimed.id, err: errorSummary(error) }, 'upstream call failed unexpectedly');
      return { ok: false, code: 'upstream_invalid_response', detail: 'the answer could not be processed', upstreamStatus: null };
    }
  }

  async function record(
    id: string,
    attempt: number,
    outcome: AttemptOutcome,
    durationMs: number,
    leaseJobId?: string,
  ): Promise<Recorded> {
    if (outcome.ok) {
      const done = await db(() =>
        finishes.submit({
          kind: 'completed',
          id,
          attempt,
          result: outcome.result,
          upstreamStatus: outcome.upstreamStatus,
          durationMs,
          leaseJobId,
        }),
      );
      if (done) finished(id);
      log.debug({ requestId: id, attempt, durationMs, stale: !done }, 'attempt succeeded');
      return done ? { status: 'completed', result: outcome.result } : { status: 'stale' };
    }
    const failure = { code: outcome.code, detail: outcome.detail, upstreamStatus: outcome.upstreamStatus, durationMs };
    return fail(id, attempt, failure, outcome.retryAfterMs, leaseJobId);
  }

  async function fail(
    id: string,
    attempt: number,
    failure: AttemptFailure,
    retryAfterMs?: number,
    leaseJobId?: string,
  ): Promise<Recorded> {
    const retryable = ATTEMPT_ERRORS[failure.code as keyof typeof ATTEMPT_ERRORS]?.retryable ?? false;
    if (retryable && attempt < deps.config.maxAttempts) {
      const delayMs = failure.code === 'worker_lost' ? 0 : retryDelay(deps.config, attempt, retryAfterMs);
      const scheduled = await db(() =>
        finishes.submit({ kind: 'retrying', id, attempt, delayMs, leaseJobId, ...failure }),
      );
      log.info({ requestId: id, attempt, code: failure.code, delayMs, stale: !scheduled }, 'attempt failed; retry scheduled');
      return { status: scheduled ? 'retrying' : 'stale' };
    }
    const failed = await db(() => finishes.submit({ kind: 'failed', id, attempt, leaseJobId, ...failure }));
    if (failed) finished(id);
    log.info({ requestId: id, attempt, code: failure.code, stale: !failed }, 'attempt failed; request failed');
    return { status: failed ? 'failed' : 'stale' };
  }

  function finished(id: string): void {
    try {
      deps.onFinished?.(id);
    } catch (error) {
      // The outcome is committed; a failure to wake local waiters must not fail the job (they
      // also hear the NOTIFY).
      log.warn({ requestId: id, err: errorSummary(error) }, 'waking local waiters failed');
    }
  }
}

/** The graphile-worker task: one job, one attempt of one request. */
export function processRequestTask(attempts: Attempts, logger: Logger): Task {
  const log = logger.child({ component: 'worker' });
  return async (rawPayload, helpers: JobHelpers) => {
    const parsed = v.safeParse(ProcessRequestPayload, rawPayload);
    if (!parsed.success) {
      // Retrying cannot fix a payload that names no request; drop the job, loudly.
      log.error({ jobId: helpers.job.id }, 'process_request job with an invalid payload dropped');
      return;
    }
    const { request_id: id, attempt } = parsed.output;

    if (helpers.abortSignal.aborted) throw new Error('shutting down: attempt not started');
    const claimed = await attempts.claim({ id, attempt, workerId: helpers.job.locked_by });
    if (!claimed) {
      await attempts.recoverLostAttempt(id, attempt);
      return;
    }
    await attempts.run(claimed, helpers.abortSignal);
  };
}

/**
 * Claims a group. Two jobs naming the same request in one group (only possible while a lost
 * attempt is being recovered) must not both believe they started it: only the first is sent.
 */
function claimGroup(db: Db, items: Claim[]): Promise<(ClaimedAttempt | undefined)[]> {
  return writeFirsts(items, (item) => item.id, (firsts) => repository.claimAttempts(db, firsts), undefined);
}
