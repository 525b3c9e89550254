// Accepting, waiting for and looking up requests. No HTTP in here: callers pass the caller's
// Auth and a validated Submission, and shape the answer themselves.
import type { Config } from '../config.ts';
import { TERMINAL_STATUSES, type RequestStatus } from '../db/database.ts';
import { isDatabaseUnavailable, type Db } from '../db/pool.ts';
import { abortAfter } from '../grace.ts';
import { ApiError, idempotencyKeyReused, requestAlreadyFinished, requestNotFound } from '../errors.ts';
import { newRequestId, REQUEST_ID, type KeyMode } from '../ids.ts';
import { deleteNonce, insertNonce, type Nonce } from '../keys/repository.ts';
import type { Batcher } from '../db/batcher.ts';
import type { Auth } from '../keys/auth.ts';
import type { Metrics } from '../metrics.ts';
import { replayedRequest, type VerifiedSignature } from '../keys/signatures.ts';
import type { StartReservation } from '../lanes/repository.ts';
import type { QueueCreation, QueueRouter, Routed } from '../lanes/routing.ts';
import type { InsertBatcher } from './insert-batcher.ts';
import type { Intake } from './intake.ts';
import { cancelRequest } from './cancel-repository.ts';
import { findAnswerByIdempotencyKey, isQueueGone, type InsertResult, type NewRequest, type RequestAnswer } from './insert-repository.ts';
import type { RequestRow } from './read-repository.ts';
import type { RecordRow } from './record.ts';
import type { Submission } from './schemas.ts';
import type { Watch, Waiters } from './waiters.ts';


export interface RequestDeps {
  db: Db;
  inserts: InsertBatcher;
  /** Reads requests by id, concurrent reads together (reads.ts). */
  reads: Batcher<string, RequestRow | undefined>;
  waiters: Waiters;
  metrics: Metrics;
  config: Pick<Config, 'waitTimeoutMs' | 'requestDeadlineMs'>;
  queues: QueueRouter;
  /** RATE_LIMIT_RPS and MAX_UNFINISHED_PER_PROJECT (NO_INTAKE_LIMITS when none is set). */
  intake: Intake;
  /**
   * Told the queue of each request just stored: a process that also runs a worker dispatches it
   * at once, rather than when its queued dispatch job is fetched.
   */
  onStored?: ((queueId: string) => void) | undefined;
  /**
   * Where this process also runs a worker: reserves room for the call of a wait=true request
   * about to be stored in the queue, which the accept may then start itself (no claim after it).
   */
  reserveStart?: ((queueId: string) => StartReservation | undefined) | undefined;
}

export interface SubmitOptions {
  /** The verified signature of the request, whose nonce is recorded with it. */
  signature?: VerifiedSignature | undefined;
  /** The size of the body as it was sent, which RATE_LIMIT_BYTES_PER_SECOND counts (else: the body stored). */
  bodyBytes?: number | undefined;
}

export type SubmitOutcome =
  | { kind: 'completed'; id: string; replayed: boolean; result: string }
  | { kind: 'acknowledged'; id: string; replayed: boolean; status: RequestStatus; created: Date };

/** A wait=true request stored and waiting: `outcome` settles when it finishes or the wait is over. */
export interface Waiting {
  kind: 'waiting';
  outcome: Promise<SubmitOutcome>;
  /** Ends the wait now (the client hung up); the request itself is unaffected. */
  abort(): void;
}

const isTerminal = (status: RequestStatus) => TERMINAL_STATUSES.includes(status);

/**
 * Checks the intake limits, routes the request to its queue, and stores it there with a dispatch
 * of the queue (or finds the one its idempotency key names). Resolves only after the request is
 * committed, so every id it returns is durable. For wait=true, unless the request has finished
 * already, it resolves then with the wait under way (Waiting), which holds on until the request
 * finishes or the wait timeout passes. Thousands of requests may wait at once: the wait keeps
 * only what it needs, not the submission nor the caller's frames.
 */
export async function submit(
  deps: RequestDeps,
  auth: Auth,
  submission: Submission,
  options: SubmitOptions = {},
): Promise<SubmitOutcome | Waiting> {
  const id = newRequestId();
  // The intake limits first: a refused request stores nothing, not even its model's queue.
  deps.intake.admitSubmission(auth, options.bodyBytes ?? Buffer.byteLength(submission.body), id);
  let storedAsOwn = false;
  let watch: Watch | undefined;
  let start: StartReservation | undefined;
  let routed: Routed | undefined;
  const nonce = nonceOf(auth, options.signature);
  try {
    let replay: Stored | undefined;
    try {
      routed = await deps.queues.route(auth.mode, submission);
    } catch (error) {
      replay = await replayOfRefused(deps, auth, submission, nonce, error);
    }
    // Watching before the row exists means its completion cannot slip past us.
    watch = submission.wait ? deps.waiters.watch(id) : undefined;
    // Someone waits for the answer: the accept may start the call, saving the claim's round trip
    // (not in a queue created with it: no lane of it is known yet).
    start = submission.wait && routed?.queueId !== undefined ? deps.reserveStart?.(routed.queueId) : undefined;
    const stored = routed ? await store(deps, auth, submission, id, routed, nonce, start) : replay!;
    storedAsOwn = !stored.replayed;
    let answer: Answer = stored.answer;
    const deadline = Date.now() + deps.config.waitTimeoutMs;
    if (!stored.replayed) {
      if (start && answer.status === 'processing') start.start(id, submission.body);
      else deps.onStored?.(stored.queueId);
    }
    if (watch && answer.id !== id) {
      // An idempotent replay: watch the existing request instead, then read it again.
      watch.close();
      watch = deps.waiters.watch(answer.id);
      const read = await readWithin(deps, answer.id, deadline - Date.now());
      if (read !== undefined && read !== TIMED_OUT) answer = read;
    }
    if (!watch || isTerminal(answer.status)) return outcomeOf(answer, stored.replayed, submission.wait);
    const waiting = startWaiting(deps, watch, answer, stored.replayed, deadline);
    watch = undefined; // the wait closes it
    return waiting;
  } finally {
    routed?.creation?.release();
    start?.release();
    watch?.close();
    // MAX_UNFINISHED_PER_PROJECT counts only requests stored as their own: not a replay, nor
    // one refused or failed after its admission.
    if (!storedAsOwn) deps.intake.withdraw(auth, id);
  }
}

/** A request stored in its queue, or one found by its idempotency key (replayed). */
type Stored = { answer: RequestAnswer; replayed: false; queueId: string } | { answer: RequestAnswer; replayed: true };

/**
 * The request that a submission refused by routing replays, or the refusal thrown again. The
 * upstreams may have changed since a request was accepted: its model no longer served, or its
 * prompt or test-delay beyond what is allowed now. A retry of it (the same idempotency key and
 * body) is still answered with it, as the contract has every replay answered. Only a refused
 * submission that carries a key pays this lookup; one that replays nothing is refused as it was,
 * storing nothing, not even its nonce.
 */
async function replayOfRefused(
  deps: RequestDeps,
  auth: Auth,
  submission: Submission,
  nonce: Nonce | undefined,
  refusal: unknown,
): Promise<Stored> {
  if (submission.idempotencyKey === undefined || !(refusal instanceof ApiError) || refusal.status !== 400) throw refusal;
  const held = await heldByKey(deps, { project_id: auth.projectId, mode: auth.mode }, submission, nonce);
  // The same key with another body is refused for its model, which is checked first (docs/api.md).
  if ('replay' in held) return held.replay;
  throw refusal;
}

/**
 * What the submission's idempotency key holds in its project and mode: the request it replays
 * (the same body), its nonce (if given) used up as a new request's is; or whether another
 * request holds the key (`taken`: a body of its own).
 */
async function heldByKey(
  deps: RequestDeps,
  scope: { project_id: string; mode: KeyMode },
  submission: Submission,
  nonce: Nonce | undefined,
): Promise<{ replay: Stored } | { taken: boolean }> {
  const existing = await findAnswerByIdempotencyKey(deps.db, scope, submission.idempotencyKey!);
  if (!existing || !existing.body_sha256.equals(submission.bodySha256)) return { taken: existing !== undefined };
  if (nonce && !(await insertNonce(deps.db, nonce))) throw replayedRequest();
  return { replay: { answer: existing, replayed: true } };
}

async function store(
  deps: RequestDeps,
  auth: Auth,
  submission: Submission,
  id: string,
  routed: Routed,
  nonce: Nonce | undefined,
  start: StartReservation | undefined,
): Promise<Stored> {
  const request: NewRequest = {
    id,
    project_id: auth.projectId,
    mode: auth.mode,
    api_key_id: auth.keyId,
    model: submission.model,
    body: submission.body,
    body_sha256: submission.bodySha256,
    idempotency_key: submission.idempotencyKey ?? null,
    queue_id: routed.queueId ?? '',
    prompt_tokens_estimate: routed.promptTokensEstimate,
    // A key's own deadline can only shorten REQUEST_DEADLINE.
    deadline_ms: Math.min(auth.requestDeadlineMs ?? Infinity, deps.config.requestDeadlineMs),
    start: start && { laneId: start.laneId, workerId: start.workerId },
  };
  // The nonce until it is stored: an insert that finds the idempotency key taken stores it, unless
  // it was creating the request's queue (its transaction rolled back).
  let unstored = nonce;
  // Twice at most: the request holding the idempotency key may be deleted (retention) between
  // the insert that found it and the read that looks for it.
  for (let tries = 1; ; tries++) {
    // A creation runs once: a second try routes again.
    if (tries > 1 && routed.creation) routed = await deps.queues.route(auth.mode, submission);
    const inserted = await insertRouted(deps, auth, submission, request, routed, unstored);
    if (inserted.kind === 'replayed_nonce') throw replayedRequest();
    if (inserted.kind === 'inserted') {
      deps.metrics.accepted.inc({ mode: auth.mode });
      return { answer: inserted.answer, replayed: false, queueId: request.queue_id };
    }
    if (!inserted.rolledBack) unstored = undefined;

    // The key is taken: by the time the insert gave way, the request holding it was committed.
    const held = await heldByKey(deps, request, submission, unstored);
    if ('replay' in held) return held.replay;
    if (held.taken || tries >= 2) {
      // A refused request stores nothing: not even its nonce.
      if (nonce && !unstored) await deleteNonce(deps.db, nonce);
      if (held.taken) throw idempotencyKeyReused();
      throw new Error('the request holding this idempotency key kept disappearing');
    }
  }
}

/** An insert's result; `rolledBack`: it created the request's queue, and nothing of it was stored. */
type RoutedInsert = InsertResult & { rolledBack?: boolean };

/**
 * Inserts the request: with the others of the moment in the queue routed to, or, for a model
 * without a queue yet, in the transaction that creates it, which commits only if the request is
 * stored. A queue is pruned only once idle for a while, and a process looks up the queues it
 * routes to more often than that; but should the request's queue have been pruned since all the
 * same, the insert stored nothing, and the request is routed again (a new queue).
 */
async function insertRouted(
  deps: RequestDeps,
  auth: Auth,
  submission: Submission,
  request: NewRequest,
  routed: Routed,
  nonce: Nonce | undefined,
): Promise<RoutedInsert> {
  if (routed.creation) return insertCreating(deps, routed.creation, request, nonce);
  try {
    request.queue_id = routed.queueId!;
    return await deps.inserts.insert(request, nonce);
  } catch (error) {
    if (!isQueueGone(error)) throw error;
    deps.queues.forget(auth.mode, submission.model);
    const again = await deps.queues.route(auth.mode, submission);
    if (again.creation) return insertCreating(deps, again.creation, request, nonce);
    request.queue_id = again.queueId!;
    return deps.inserts.insert(request, nonce);
  }
}

async function insertCreating(deps: RequestDeps, creation: QueueCreation, request: NewRequest, nonce: Nonce | undefined): Promise<RoutedInsert> {
  const inserted = await deps.inserts.timedTransaction(() =>
    creation.run(
      (tx, queueId) => {
        request.queue_id = queueId;
        return deps.inserts.insertIn(tx, request, nonce);
      },
      (result) => result.kind === 'inserted',
    ),
  );
  return inserted.kind === 'inserted' ? inserted : { ...inserted, rolledBack: true };
}

function nonceOf(auth: Auth, signature: VerifiedSignature | undefined): Nonce | undefined {
  return signature && { api_key_id: auth.keyId, nonce: signature.nonce };
}

function startWaiting(deps: RequestDeps, watch: Watch, answer: Answer, replayed: boolean, deadline: number): Waiting {
  return {
    kind: 'waiting',
    outcome: waitForOutcome(deps, watch, answerOf(answer), replayed, deadline),
    abort: () => watch.abort(),
  };
}

type Answer = Pick<RequestAnswer, 'id' | 'status' | 'created_at' | 'result'>;

/** What a wait keeps of a row: only what its answer needs. */
const answerOf = (row: Answer): Answer => ({ id: row.id, status: row.status, created_at: row.created_at, result: row.result });

async function waitForOutcome(
  deps: RequestDeps,
  watch: Watch,
  answer: Answer,
  replayed: boolean,
  deadline: number,
): Promise<SubmitOutcome> {
  try {
    return outcomeOf(await waitForTerminal(deps, watch, answer, deadline), replayed, true);
  } finally {
    watch.close();
  }
}

const HANDED_OVER = Symbol('handed over');

async function waitForTerminal(deps: RequestDeps, watch: Watch, answer: Answer, deadline: number): Promise<Answer> {
  let current = answer;
  while (!isTerminal(current.status)) {
    const remaining = deadline - Date.now();
    if (remaining <= 0) break;
    const event = await watch.next(remaining);
    if (event === 'aborted') break;
    if (event === 'completed') return completedWith(current, watch.result!);
    // A worker of this process hands its result over a moment after its NOTIFY may have woken
    // us: whichever of that and the read comes first answers.
    const read = readWithin(deps, watch.id, deadline - Date.now());
    read.catch(() => {}); // its failure is thrown below if it comes first
    const row = await Promise.race([read, watch.handedOver().then((): typeof HANDED_OVER => HANDED_OVER)]);
    if (row === HANDED_OVER) return completedWith(current, watch.result!);
    // The read outlasted the wait (a connection gone silent): the waiter is answered with what is known.
    if (row === TIMED_OUT) break;
    if (row) current = row;
    if (event !== 'changed') break;
  }
  return current;
}

const completedWith = (answer: Answer, result: string): Answer => ({ ...answer, status: 'completed', result });

const TIMED_OUT = Symbol('timed out');

/**
 * The request's row, as readRow gives it, or TIMED_OUT once `ms` (and the read's grace) have
 * passed without it: a pooled connection that went silent must not hold a waiter past its wait.
 */
async function readWithin(deps: RequestDeps, id: string, ms: number): Promise<Answer | undefined | typeof TIMED_OUT> {
  const timer = new AbortController();
  const stop = abortAfter(timer, Math.max(0, ms));
  const timedOut = new Promise<typeof TIMED_OUT>((resolve) => timer.signal.addEventListener('abort', () => resolve(TIMED_OUT), { once: true }));
  try {
    return await Promise.race([readRow(deps, id), timedOut]);
  } finally {
    stop();
  }
}

async function readRow(deps: RequestDeps, id: string): Promise<Answer | undefined> {
  try {
    const row = await deps.reads.submit(id);
    return row && answerOf(row);
  } catch (error) {
    // The request is committed and its id is ours to give: a database outage during the
    // wait must not turn that into an error. Keep polling; at worst answer what we know.
    if (!isDatabaseUnavailable(error)) throw error;
    return undefined;
  }
}

function outcomeOf(answer: Answer, replayed: boolean, wait: boolean): SubmitOutcome {
  if (wait && answer.status === 'completed' && answer.result !== null) {
    return { kind: 'completed', id: answer.id, replayed, result: answer.result };
  }
  return { kind: 'acknowledged', id: answer.id, replayed, status: answer.status, created: answer.created_at };
}

/** The caller's request with that id; 404 for an unknown id or one of another project or mode. */
export async function lookup(deps: Pick<RequestDeps, 'reads' | 'intake'>, auth: Auth, id: string): Promise<RequestRow> {
  deps.intake.admitLookup(auth);
  if (!REQUEST_ID.test(id)) throw requestNotFound();
  const row = await deps.reads.submit(id);
  if (row === undefined || row.project_id !== auth.projectId || row.mode !== auth.mode) throw requestNotFound();
  return row;
}

/**
 * Cancels the caller's request: one that has not ended becomes cancelled (a call under way is
 * aborted by the worker that holds it); a cancelled one answers its record again; a completed or
 * failed one is a 409; an unknown id, or one of another project or mode, a 404.
 */
export async function cancel(
  deps: Pick<RequestDeps, 'db' | 'intake' | 'metrics'>,
  auth: Auth,
  id: string,
  options: SubmitOptions = {},
): Promise<RecordRow> {
  deps.intake.admitLookup(auth);
  if (!REQUEST_ID.test(id)) throw requestNotFound();
  // A POST: its nonce is accepted once, as a submission's is, and stored only with a cancel that
  // is answered 200: a refused one (404, 409) rolls it back. The same nonce sent twice at once
  // waits on the first's insert, and is a replay if that one commits.
  const nonce = nonceOf(auth, options.signature);
  const outcome = await deps.db.transaction().execute(async (tx) => {
    if (nonce && !(await insertNonce(tx, nonce))) throw replayedRequest();
    const found = await cancelRequest(tx, { project_id: auth.projectId, mode: auth.mode }, id);
    if (found === undefined) throw requestNotFound();
    if (!('record' in found)) throw requestAlreadyFinished(found.previousStatus);
    return found;
  });
  if (outcome.previousStatus !== 'cancelled') deps.metrics.cancelled.inc({ mode: auth.mode, from: outcome.previousStatus });
  return outcome.record;
}
