// Running one attempt that a dispatch started (worker/dispatcher.ts): call the lane's upstream
// (the simulator in test mode) with no database connection held, then record how it ended:
// completed with its usage, failed, or retrying, when its queue is dispatched again for it.
// Whether a failure is charged toward MAX_ATTEMPTS is decided as it is recorded, from its lane's
// health (attempts-repository.ts); an upstream 429 also pauses the whole lane, and the
// provider's failures open it. The outcomes of attempts that end at about the same time are
// written together (db/batcher.ts): one statement and one commit for all of them.
// An attempt cut short by a shutdown after SHUTDOWN_GRACE_MS, or whose worker died (found by
// the supervisor's sweep), is recorded as worker_lost and retried at once; charged only when its
// worker died (a request may bring its worker down), never for the shutdown.
//
// An outcome is recorded however long the database stays unavailable (retried with backoff):
// giving up would leave the attempt running, to be recovered as worker_lost and called again,
// throwing away an answer already paid for. Only a shutdown past its grace gives up
// (abandonRecordings). A recording given up, or cut short by the process being killed, leaves
// its attempt running in the database: the supervisor's sweep, in another worker or in this one
// started again, records it as worker_lost once this worker's heartbeat is gone, and its
// request is retried. A recording that lost a deadlock or a serialization conflict is made
// again, a few times at most.
//
// A completion that the database refuses for good (an answer nested deeper than Postgres's JSON
// parser goes, say) is recorded as a plain failure instead, upstream_invalid_response with no
// result, and retried as such: the sweep never recovers an attempt of this live worker, so left
// running it would hold its request in processing, and its lane's room, until the deadline.
//
// A claim leaves a large body out (lanes/repository.ts): its attempt reads it first, one at a
// time in this process, so that a project's prompts of megabytes hold no other request up, in
// their claim or in the worker's pool.
import { doubling, jitter } from '../client/backoff.ts';
import type { Config } from '../config.ts';
import { Batcher, GROUP_BYTES } from '../db/batcher.ts';
import { errorSummary, isDatabaseUnavailable, type Db } from '../db/pool.ts';
import { CONFLICT_RETRIES, whileUnavailable } from '../db/retry.ts';
import { ABORTED_AS_ENDED, ABORTED_BY_SHUTDOWN } from '../grace.ts';
import { Line } from '../line.ts';
import type { KeyMode } from '../ids.ts';
import type { StartedAttempt } from '../lanes/repository.ts';
import { SIMULATOR, type Upstream } from '../upstream/upstreams.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { UpstreamClient } from '../upstream/openai.ts';
import { ATTEMPT_ERRORS, type AttemptErrorCode, type AttemptOutcome, type Fault } from '../upstream/outcome.ts';
import { simulate } from '../upstream/simulator.ts';
import { LANE_HEALTH } from '../lanes/health.ts';
import { findBody, finishAttempts, type Finish, type Finished, type LostAttempt } from './attempts-repository.ts';
import { reportLaneChange } from './lane-changes.ts';

export interface AttemptDeps {
  db: Db;
  config: Pick<Config, 'maxAttempts' | 'retryBaseMs' | 'retryMaxMs' | 'upstreamMaxResponseBytes' | 'upstreamAnswerMemoryBytes'>;
  metrics: Metrics;
  logger: Logger;
  /** The wait=true requests of this process, when it also serves the API. */
  waiters?: RecordingWaiters;
}

/**
 * What the waiters of this process hear of the outcomes its worker records. The committing
 * statement's NOTIFY often arrives before its own answer does: told that a request's outcome is
 * being recorded, the waiters wait for the recording rather than read the row, and a completion
 * is handed over with its result.
 */
export interface RecordingWaiters {
  /** An outcome of this request is about to be recorded. */
  recording(id: string): void;
  /**
   * The recording is over: `result` when the request completed (as committed), `ended` when it
   * completed or failed; neither when it was retried, had ended meanwhile, or was given up.
   */
  recorded(id: string, outcome: { result?: string; ended: boolean }): void;
}

/** Where an attempt's call goes: a lane's upstream, or the simulator for a test-mode lane. */
export interface CallTarget {
  mode: KeyMode;
  /** undefined: the simulator. */
  upstream: Upstream | undefined;
  /** The upstream's own name for the model, when the file renames it (the body's model is replaced). */
  model: string | undefined;
  /** The model as a metrics label: bounded by the configuration, never a client's free text. */
  modelLabel: string;
}

// A retry-after longer than this is not honoured in full: a request must not sleep for days,
// nor a lane stay paused for them.
export const MAX_RETRY_AFTER_MS = 60 * 60 * 1000;

/**
 * The wait before the retry after attempt `failedAttempt` failed: full jitter, a random time in
 * [0, min(max, base * 2^(n-1))] (RETRY_BASE_MS, RETRY_MAX_MS), so that requests that failed
 * together do not retry together; never shorter than a retry-after (honoured up to an hour).
 */
export function retryDelay(
  settings: Pick<Config, 'retryBaseMs' | 'retryMaxMs'>,
  failedAttempt: number,
  retryAfterMs?: number,
  random: () => number = Math.random,
): number {
  const jittered = Math.floor(jitter(doubling(failedAttempt, settings.retryBaseMs, settings.retryMaxMs), 1, 0, random));
  return retryAfterMs === undefined ? jittered : Math.max(jittered, Math.min(retryAfterMs, MAX_RETRY_AFTER_MS));
}

export interface Attempts {
  /**
   * Calls the upstream with no database connection held, then records the outcome. Never rejects.
   * Resolves with how long until the request's retry is due, when it recorded one.
   */
  run(target: CallTarget, started: StartedAttempt, signal: AbortSignal): Promise<number | undefined>;
  /**
   * Records attempts whose worker died as worker_lost, and retries them at once, attempts left:
   * resolves with the retries it recorded, each with its queue and how long until it is due (as
   * run() does), for the caller to dispatch.
   */
  recover(lost: readonly LostAttempt[]): Promise<{ queueId: string; retryInMs: number }[]>;
  /**
   * The shutdown's grace is over: outcomes still waiting for the database to record them are
   * given up after their current try, and so are those that come after.
   */
  abandonRecordings(): void;
  /** Closes the upstream connections, once no call is in flight. */
  close(): Promise<void>;
}

// How long recording a lost attempt is retried while the database is unavailable: the
// supervisor's next sweeps find the attempt again if this one gives up.
const RECOVERY_PATIENCE_MS = 60_000;
// Finish statements under way at once (each holds a connection while it runs).
const GROUP_STATEMENTS_IN_FLIGHT = 2;

/** What a finish weighs in a group: its result, or its error detail. */
const finishBytes = (finish: Finish) => Buffer.byteLength(finish.kind === 'completed' ? finish.result : finish.detail);

export function createAttempts(deps: AttemptDeps): Attempts {
  const log = deps.logger.child({ component: 'worker' });
  const upstreams = new UpstreamClient({
    maxResponseBytes: deps.config.upstreamMaxResponseBytes,
    answerMemoryBytes: deps.config.upstreamAnswerMemoryBytes,
  });
  deps.metrics.watchAnswerMemory(upstreams.answerMemory);
  const settings = { maxAttempts: deps.config.maxAttempts, health: LANE_HEALTH };
  const finishes = new Batcher<Finish, Finished>(async (items) => {
    const { finished, laneChanges } = await finishAttempts(deps.db, items, settings);
    for (const change of laneChanges) reportLaneChange({ metrics: deps.metrics, log }, change);
    return finished;
  }, {
    maxInFlight: GROUP_STATEMENTS_IN_FLIGHT,
    maxBatch: 500,
    maxBytes: { max: GROUP_BYTES, sizeOf: finishBytes },
    onDone: (seconds) => deps.metrics.durableWrites.observe({ write: 'finish' }, seconds),
  });
  const abandoning = new AbortController();
  // Large bodies, read one at a time (each holds a connection while megabytes come through it).
  // None is refused: each belongs to a call already claimed, and capacity bounds those.
  const largeBodies = new Line({ inFlight: 1, waiting: Number.POSITIVE_INFINITY, refusal: () => new Error('unreachable: the line of large bodies is unbounded') });
  /**
   * Records a finish, retrying while the database is unavailable: until abandoned, or for
   * `maxWaitMs`; and after a conflict with another transaction, CONFLICT_RETRIES times at most.
   * The waiters of this process hear of it (`result`: a completion's, to hand over).
   */
  async function record(finish: Finish, { maxWaitMs, result }: { maxWaitMs?: number; result?: string } = {}): Promise<Finished> {
    tell(finish.id, () => deps.waiters?.recording(finish.id));
    let done: Finished = null;
    try {
      done = await whileUnavailable(() => finishes.submit(finish), {
        ...(maxWaitMs === undefined ? {} : { maxWaitMs }),
        signal: abandoning.signal,
        conflicts: CONFLICT_RETRIES,
        log: { logger: log, message: 'database unavailable; retrying the recording until it is back', fields: { requestId: finish.id } },
      });
      return done;
    } finally {
      const completed = done?.status === 'completed';
      tell(finish.id, () => deps.waiters?.recorded(finish.id, { ...(completed ? { result } : {}), ended: completed || done?.status === 'failed' }));
    }
  }

  function tell(requestId: string, hear: () => void): void {
    try {
      hear();
    } catch (error) {
      // The outcome stands; a failure to tell local waiters must not fail the attempt (they
      // also hear the NOTIFY, and their own time runs out).
      log.warn({ requestId, err: errorSummary(error) }, 'telling local waiters failed');
    }
  }

  async function run(target: CallTarget, started: StartedAttempt, signal: AbortSignal): Promise<number | undefined> {
    const body = started.body ?? (await largeBody(started.id, signal));
    const begun = performance.now();
    let outcome: AttemptOutcome =
      body === undefined
        ? { ok: false, code: 'worker_lost', detail: "the worker could not read the request's body", upstreamStatus: null }
        : await call(target, started, body, signal);
    const durationMs = Math.round(performance.now() - begun);
    if (signal.reason === ABORTED_AS_ENDED) {
      deps.metrics.attempts.inc({ mode: target.mode, outcome: 'cancelled', code: 'none' });
      log.debug({ requestId: started.id, attempt: started.attempt, durationMs }, 'call aborted: its request ended meanwhile');
      return undefined;
    }
    const shutDown = !outcome.ok && signal.reason === ABORTED_BY_SHUTDOWN;
    if (shutDown) {
      outcome = { ok: false, code: 'worker_lost', detail: 'the worker shut down before the upstream answered', upstreamStatus: null };
    }
    const result = outcome.ok ? 'succeeded' : 'failed';
    deps.metrics.upstreamDuration.observe({ mode: target.mode, outcome: result }, durationMs / 1000);
    // gateway_attempts_total: an attempt by the outcome it is recorded with (a completion the
    // database refuses, as the failure it is recorded as instead), once its recording has
    // answered. Not one whose end another process recorded first (`done` null: a sweep took this
    // worker for dead and counted it as worker_lost, or its request ended meanwhile), nor one
    // whose recording was given up (the sweep counts it, once it records it as worker_lost).
    const counted = (done: Finished, code: AttemptErrorCode | 'none') => {
      if (done) deps.metrics.attempts.inc({ mode: target.mode, outcome: code === 'none' ? 'succeeded' : 'failed', code });
    };
    try {
      if (outcome.ok) {
        const { usage, upstreamStatus } = outcome;
        let done: Finished;
        try {
          done = await record(
            { kind: 'completed', id: started.id, attempt: started.attempt, laneId: started.laneId, result: outcome.result, usage, upstreamStatus, durationMs },
            { result: outcome.result },
          );
        } catch (error) {
          if (isDatabaseUnavailable(error) || abandoning.signal.aborted) throw error;
          log.error({ requestId: started.id, err: errorSummary(error) }, "could not store the provider's answer; recording the attempt as failed instead");
          const detail = "the provider's answer could not be stored";
          const failed = await fail(started, { code: 'upstream_invalid_response', detail, upstreamStatus, durationMs });
          counted(failed, 'upstream_invalid_response');
          return failed?.retryInMs;
        }
        counted(done, 'none');
        if (done) {
          // gateway_tokens_total: a completion's usage, by its lane.
          const labels = { mode: target.mode, upstream: target.upstream?.name ?? SIMULATOR, model: target.modelLabel };
          if (usage.prompt !== null) deps.metrics.tokens.inc({ ...labels, kind: 'prompt' }, usage.prompt);
          if (usage.completion !== null) deps.metrics.tokens.inc({ ...labels, kind: 'completion' }, usage.completion);
        }
        log.debug({ requestId: started.id, attempt: started.attempt, durationMs, stale: !done }, 'attempt succeeded');
      } else {
        const { code, detail, upstreamStatus } = outcome;
        const failed = await fail(started, { code, detail, upstreamStatus, durationMs, retryAfterMs: outcome.retryAfterMs, shutDown });
        counted(failed, code);
        return failed?.retryInMs;
      }
    } catch (error) {
      // The attempt stays running in the database. Abandoned at shutdown, it is this worker's
      // last: the sweep of another records it as worker_lost once this one's heartbeat is gone.
      // Otherwise (a failure that no retry mends, even recorded without a result) this worker
      // vouches for it while it lives: its request ends at its deadline.
      const fate = abandoning.signal.aborted
        ? 'recording given up at shutdown; the attempt stays running until a sweep records it as worker_lost'
        : "could not record an attempt; it stays running until its request's deadline, or a sweep after this worker has stopped";
      log.error({ requestId: started.id, attempt: started.attempt, err: errorSummary(error) }, fate);
    }
    return undefined;
  }

  async function call(target: CallTarget, started: StartedAttempt, body: string, signal: AbortSignal): Promise<AttemptOutcome> {
    const request = { body: target.model === undefined ? body : renamed(body, target.model), signal };
    try {
      return target.upstream === undefined
        ? await simulate({ ...request, attempt: started.attempt })
        : await upstreams.call(target.upstream, request);
    } catch (error) {
      // The callers classify every failure they know; anything else is a bug on our side,
      // recorded as an invalid response so the request still ends (after its retries).
      log.error({ requestId: started.id, err: errorSummary(error) }, 'upstream call failed unexpectedly');
      return { ok: false, code: 'upstream_invalid_response', detail: 'the answer could not be processed', upstreamStatus: null };
    }
  }

  /**
   * The body that the attempt's claim left out, read while the database stays unavailable, until
   * the call is aborted or the recordings abandoned. undefined if it could not be read, or its
   * request has ended meanwhile (the call is aborted then too).
   */
  async function largeBody(requestId: string, signal: AbortSignal): Promise<string | undefined> {
    try {
      return await whileUnavailable(() => largeBodies.run(() => findBody(deps.db, requestId)), {
        signal: AbortSignal.any([signal, abandoning.signal]),
        log: { logger: log, message: "database unavailable; retrying the read of a request's body until it is back", fields: { requestId } },
      });
    } catch (error) {
      if (!signal.aborted) log.error({ requestId, err: errorSummary(error) }, "could not read a request's body");
      return undefined;
    }
  }

  /**
   * Records a failed attempt: the request is retried, or fails, as its fault and its lane's health
   * decide. null when the attempt had ended already (another process recorded it first).
   */
  async function fail(
    started: Pick<StartedAttempt, 'id' | 'attempt' | 'charged'>,
    failure: {
      code: AttemptErrorCode;
      detail: string;
      upstreamStatus: number | null;
      durationMs: number | null;
      retryAfterMs?: number | undefined;
      /** Cut short by this worker's shutdown past its grace: worker_lost, not charged. */
      shutDown?: boolean;
    },
    patienceMs?: number,
  ): Promise<Finished> {
    const { id, attempt } = started;
    const { retryAfterMs, shutDown, ...report } = failure;
    const { retryable, fault: codeFault } = ATTEMPT_ERRORS[failure.code];
    const fault: Fault = shutDown ? 'shutdown' : codeFault;
    // Only a 429's retry-after is waited for. The provider's failures (a 503 asking for an hour,
    // say) are for its lane's health to answer: a retry the lane's outage holds back goes as soon
    // as a probe finds the provider back, and one waiting out a retry-after would not.
    const waitMs = fault === 'rate_limited' ? retryAfterMs : undefined;
    // The backoff after the request's charged attempts, if this one is charged too; if not (a
    // 429, an outage), one that grows with every attempt.
    const delayMs = failure.code === 'worker_lost' ? 0 : retryDelay(deps.config, started.charged + 1, waitMs);
    const unchargedDelayMs = retryDelay(deps.config, attempt, waitMs);
    // A 429 pauses the lane for its retry-after (an hour at most), or for the backoff when it sent none.
    const pauseMs = fault === 'rate_limited' ? Math.min(waitMs ?? unchargedDelayMs, MAX_RETRY_AFTER_MS) : undefined;
    const finish: Finish = retryable
      ? { kind: 'retry', id, attempt, delayMs, unchargedDelayMs, pauseMs, fault, ...report }
      : { kind: 'failed', id, attempt, pauseMs, fault, ...report };
    const done = await record(finish, patienceMs === undefined ? {} : { maxWaitMs: patienceMs });
    const fields = { requestId: id, attempt, code: failure.code };
    if (done === null) log.info(fields, 'attempt failed; its outcome was recorded already (or its request had ended)');
    else if (done.status === 'retrying') log.info({ ...fields, charged: done.charged }, 'attempt failed; retry scheduled');
    else log.info({ ...fields, charged: done.charged }, 'attempt failed; request failed');
    return done;
  }

  return {
    run,
    close: () => upstreams.close(),
    abandonRecordings: () => abandoning.abort(),
    async recover(lost) {
      const retries: { queueId: string; retryInMs: number }[] = [];
      await Promise.all(
        lost.map(async (attempt) => {
          const failure = {
            code: 'worker_lost' as const,
            detail: 'the worker running this attempt stopped before recording its outcome',
            upstreamStatus: null,
            durationMs: null,
          };
          // Every live worker sweeps when a dead one's heartbeat comes of age: the one that
          // records the attempt counts it.
          const done = await fail(attempt, failure, RECOVERY_PATIENCE_MS);
          if (done === null) return;
          if (done.retryInMs !== undefined && attempt.queue_id !== null) retries.push({ queueId: attempt.queue_id, retryInMs: done.retryInMs });
          log.warn({ requestId: attempt.id, attempt: attempt.attempt }, 'attempt lost with its worker; recorded, and retried if it may be');
          deps.metrics.attempts.inc({ mode: attempt.mode, outcome: 'failed', code: 'worker_lost' });
        }),
      );
      return retries;
    },
  };
}

/** The body with its model replaced by the upstream's own name for it. */
function renamed(body: string, model: string): string {
  return JSON.stringify({ ...(JSON.parse(body) as Record<string, unknown>), model });
}
