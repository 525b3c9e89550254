// Requests in every state, written straight into the database (with their attempts), aged as
// a test needs: for retention, views and admin commands; and requests running on one lane, for
// the tests of how their attempts are recorded (worker/attempts-repository.ts).
import { createHash } from 'node:crypto';
import type pg from 'pg';
import type { RequestStatus } from '../../src/db/database.ts';
import { newRequestId } from '../../src/ids.ts';
import type { TestGateway } from './gateway.ts';

export interface Planted {
  id: string;
  status: RequestStatus;
  ageMs: number;
}

/** Plants a request of that status, created `ageMs` ago, with one attempt per `attempts`. */
export async function plantRequest(
  gateway: TestGateway,
  key: { id: string },
  options: {
    status: RequestStatus;
    ageMs?: number;
    attempts?: { outcome: 'running' | 'succeeded' | 'failed'; code?: string; finishedAgoMs?: number }[];
    idempotencyKey?: string;
    model?: string;
    mode?: 'live' | 'test';
  },
): Promise<Planted> {
  const ageMs = options.ageMs ?? 0;
  const created = Date.now() - ageMs;
  const id = newRequestId(created);
  const body = JSON.stringify({ model: options.model ?? 'test-model', messages: [{ role: 'user', content: 'planted' }] });
  const terminal = options.status === 'completed' || options.status === 'failed';
  const attempts = options.attempts ?? [];
  const lastError = [...attempts].reverse().find((attempt) => attempt.code)?.code ?? null;
  await gateway.pool.query(
    `insert into gateway.requests
       (id, project_id, mode, api_key_id, status, attempts, last_error_code, model, body, body_sha256,
        idempotency_key, result, created_at, updated_at, finished_at)
     select $1, project_id, $2, id, $3, $4, $5, $6, $7::json, $8, $9, $10::json,
            to_timestamp($11 / 1000.0), to_timestamp($11 / 1000.0), $12
     from gateway.api_keys where id = $13`,
    [
      id,
      options.mode ?? 'test',
      options.status,
      attempts.length,
      lastError,
      options.model ?? 'test-model',
      body,
      createHash('sha256').update(body).digest(),
      options.idempotencyKey ?? null,
      options.status === 'completed' ? JSON.stringify({ id: 'chatcmpl-planted', object: 'chat.completion', choices: [] }) : null,
      created,
      terminal ? new Date(created + 1000) : null,
      key.id,
    ],
  );
  for (const [index, attempt] of attempts.entries()) {
    const finishedAgo = attempt.finishedAgoMs ?? ageMs;
    await gateway.pool.query(
      `insert into gateway.request_attempts
         (request_id, attempt_number, started_at, finished_at, outcome, upstream_status, error_code, duration_ms)
       values ($1, $2, now() - ($3::float8 + 100) * interval '1 millisecond',
               case when $4 = 'running' then null else now() - $3::float8 * interval '1 millisecond' end,
               $4, $5, $6, $7)`,
      [id, index + 1, finishedAgo, attempt.outcome, attempt.outcome === 'succeeded' ? 200 : null, attempt.code ?? null, attempt.outcome === 'running' ? null : 100],
    );
  }
  return { id, status: options.status, ageMs };
}

/**
 * A project of that name with a live key, a queue of model 'm' with one lane (upstream 'primary'),
 * and requests of these ids processing on it, each with its first attempt running: what
 * finishAttempts records. Returns the queue's and the lane's ids.
 */
export async function plantRunning(
  pool: pg.Pool,
  options: { project: string; ids: readonly string[]; promptTokensEstimate?: number },
): Promise<{ queueId: string; laneId: string }> {
  const { rows } = await pool.query<{ queue_id: string; lane_id: string }>(
    `with project as (insert into gateway.projects (name) values ($1) returning id),
     key as (
       insert into gateway.api_keys (id, project_id, mode, key_sha256, key_hint, signing_secret_ciphertext)
       select 'key_' || md5($1), id, 'live', sha256('k'), 'k', '\\x00' from project returning id, project_id
     ), queue as (insert into gateway.queues (mode, model) values ('live', 'm') returning id),
     lane as (insert into gateway.lanes (mode, upstream, model, queue_id) select 'live', 'primary', 'm', id from queue returning id, queue_id),
     requests as (
       insert into gateway.requests (id, project_id, mode, api_key_id, status, attempts, model, body, body_sha256, queue_id, lane_id,
                                     prompt_tokens_estimate)
       select ids.id, key.project_id, 'live', key.id, 'processing', 1, 'm', '{}', sha256('b'), lane.queue_id, lane.id, $3
       from key, lane, unnest($2::text[]) as ids(id)
       returning id
     ), attempts as (
       insert into gateway.request_attempts (request_id, attempt_number, worker_id, upstream) select id, 1, 'w', 'primary' from requests
     )
     select lane.queue_id::text, lane.id::text as lane_id from lane`,
    [options.project, options.ids, options.promptTokensEstimate ?? null],
  );
  return { queueId: rows[0]!.queue_id, laneId: rows[0]!.lane_id };
}
