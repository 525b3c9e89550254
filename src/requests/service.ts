// Accepting, waiting for and looking up requests. No HTTP in here: callers pass the caller's
// Auth and a validated Submission, and shape the answer themselves.
import type { Config } from '../config.ts';
import { TERMINAL_STATUSES, type RequestStatus } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import { idempotencyKeyReused, requestNotFound } from '../errors.ts';
import { newRequestId, REQUEST_ID } from '../ids.ts';
import type { Auth } from '../keys/service.ts';
import * as repository from './repository.ts';
import type { RequestAnswer, RequestRecord } from './repository.ts';
import type { Submission } from './schemas.ts';
import type { Watch, Waiters } from './waiters.ts';

export type { RequestRecord } from './repository.ts';

export interface RequestDeps {
  db: Db;
  waiters: Waiters;
  config: Pick<Config, 'waitTimeoutMs'>;
}

export type SubmitOutcome =
  | { kind: 'completed'; id: string; replayed: boolean; result: string }
  | { kind: 'acknowledged'; id: string; replayed: boolean; status: RequestStatus; created: Date };

const isTerminal = (status: RequestStatus) => TERMINAL_STATUSES.includes(status);

/**
 * Stores the request with its job (or finds the one its idempotency key names) and, for
 * wait=true, holds on until it finishes or the wait timeout passes. Resolves only after the
 * request is committed, so every id it returns is durable.
 */
export async function submit(
  deps: RequestDeps,
  auth: Auth,
  submission: Submission,
  signal?: AbortSignal,
): Promise<SubmitOutcome> {
  const scope = { project_id: auth.projectId, mode: auth.mode };
  const id = newRequestId();
  // Watching before the row exists means its completion cannot slip past us.
  let watch = submission.wait ? deps.waiters.watch(id) : undefined;
  try {
    let answer: RequestAnswer | undefined;
    let replayed = false;
    for (let tries = 0; answer === undefined; tries++) {
      answer = await repository.insertRequest(deps.db, {
        id,
        ...scope,
        api_key_id: auth.keyId,
        model: submission.model,
        body: submission.body,
        body_sha256: submission.bodySha256,
        idempotency_key: submission.idempotencyKey ?? null,
      });
      if (answer === undefined) {
        // The idempotency key is taken: by the time the insert gave way, its request was committed.
        replayed = true;
        answer = await repository.findAnswerByIdempotencyKey(deps.db, scope, submission.idempotencyKey!);
        if (answer && !answer.body_sha256.equals(submission.bodySha256)) throw idempotencyKeyReused();
        if (answer && watch) {
          watch.close();
          watch = deps.waiters.watch(answer.id);
          answer = await repository.findAnswer(deps.db, answer.id);
        }
        // Deleted between the insert and the read (retention): try the insert again.
        if (answer === undefined && tries >= 2) throw new Error('idempotent submission kept conflicting');
      }
    }
    if (watch) answer = await waitForTerminal(deps, watch, answer, signal);
    return outcomeOf(answer, replayed, submission.wait);
  } finally {
    watch?.close();
  }
}

async function waitForTerminal(
  deps: RequestDeps,
  watch: Watch,
  answer: RequestAnswer,
  signal?: AbortSignal,
): Promise<RequestAnswer> {
  const deadline = Date.now() + deps.config.waitTimeoutMs;
  let current = answer;
  while (!isTerminal(current.status)) {
    const remaining = deadline - Date.now();
    if (remaining <= 0) break;
    const event = await watch.next(remaining, signal);
    if (event === 'aborted') break;
    current = (await repository.findAnswer(deps.db, watch.id)) ?? current;
    if (event !== 'changed') break;
  }
  return current;
}

function outcomeOf(answer: RequestAnswer, replayed: boolean, wait: boolean): SubmitOutcome {
  if (wait && answer.status === 'completed' && answer.result !== null) {
    return { kind: 'completed', id: answer.id, replayed, result: answer.result };
  }
  return { kind: 'acknowledged', id: answer.id, replayed, status: answer.status, created: answer.created_at };
}

/** The caller's request with that id; 404 for an unknown id or one of another project or mode. */
export async function lookup(deps: Pick<RequestDeps, 'db'>, auth: Auth, id: string): Promise<RequestRecord> {
  if (!REQUEST_ID.test(id)) throw requestNotFound();
  const record = await repository.findRecord(deps.db, { project_id: auth.projectId, mode: auth.mode }, id);
  if (record === undefined) throw requestNotFound();
  return record;
}
