// Requests in every state, written straight into the database (with their attempts), aged as
// a test needs: for retention, views and admin commands.
import { createHash } from 'node:crypto';
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
