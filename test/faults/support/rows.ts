// Reading many requests and their attempts at once, and waiting for them to end.
import { setTimeout as sleep } from 'node:timers/promises';
import type pg from 'pg';

export interface AttemptRow {
  attempt_number: number;
  started_at: Date;
  finished_at: Date | null;
  outcome: 'running' | 'succeeded' | 'failed';
  upstream_status: number | null;
  error_code: string | null;
  error_detail: string | null;
  duration_ms: number | null;
  worker_id: string | null;
  /** The upstream that ran it. */
  upstream: string | null;
  /** Whether it counted toward MAX_ATTEMPTS (null while running, or when it succeeded). */
  charged: boolean | null;
}

export interface RequestWithAttempts {
  id: string;
  status: string;
  attempts: number;
  charged_attempts: number;
  last_error_code: string | null;
  created_at: Date;
  finished_at: Date | null;
  idempotency_key: string | null;
  result: any;
  /** By attempt_number. */
  attempt_rows: AttemptRow[];
}

/** The requests with these ids (all of them when `ids` is undefined), oldest first, each with its attempts. */
export async function requestsWithAttempts(pool: pg.Pool, ids?: string[]): Promise<RequestWithAttempts[]> {
  const { rows } = await pool.query<Omit<RequestWithAttempts, 'attempt_rows'> & { attempt_rows: any[] }>(
    `select r.id, r.status, r.attempts, r.charged_attempts, r.last_error_code, r.created_at, r.finished_at, r.idempotency_key, r.result,
            coalesce((select json_agg(a order by a.attempt_number)
                      from (select attempt_number, started_at, finished_at, outcome, upstream_status, error_code, error_detail, duration_ms,
                                   worker_id, upstream, charged
                            from gateway.request_attempts where request_id = r.id) as a), '[]') as attempt_rows
     from gateway.requests as r
     where $1::text[] is null or r.id = any($1::text[])
     order by r.created_at, r.id`,
    [ids ?? null],
  );
  return rows.map((row) => ({
    ...row,
    attempt_rows: row.attempt_rows.map((attempt) => ({
      ...attempt,
      started_at: new Date(attempt.started_at),
      finished_at: attempt.finished_at === null ? null : new Date(attempt.finished_at),
    })),
  }));
}

/** How many requests satisfy the SQL condition (written by the test itself, never from input). */
export async function countWhere(pool: pg.Pool, condition: string): Promise<number> {
  const { rows } = await pool.query<{ count: number }>(`select count(*)::int as count from gateway.requests where ${condition}`);
  return rows[0]?.count ?? 0;
}

/** Polls until every one of `ids` is completed or failed; reports how long it took, or how many were left. */
export async function waitUntilTerminal(
  pool: pg.Pool,
  ids: string[],
  timeoutMs: number,
): Promise<{ done: boolean; left: number; byStatus: Record<string, number> }> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const { rows } = await pool.query<{ status: string; count: number }>(
      `select status, count(*)::int as count from gateway.requests where id = any($1::text[]) group by status`,
      [ids],
    );
    const byStatus = Object.fromEntries(rows.map((row) => [row.status, row.count]));
    const terminal = (byStatus.completed ?? 0) + (byStatus.failed ?? 0);
    const left = ids.length - terminal;
    if (left === 0 || Date.now() > deadline) return { done: left === 0, left, byStatus };
    await sleep(200);
  }
}

/** Problems of a terminal request's attempt rows with the lifecycle rules of docs/api.md ("Statuses and lifecycle"). */
export function lifecycleProblems(request: RequestWithAttempts, maxAttempts: number): string[] {
  const problems: string[] = [];
  const attempts = request.attempt_rows;
  if (request.status !== 'completed' && request.status !== 'failed') problems.push(`status ${request.status}, not terminal`);
  if (request.attempts > maxAttempts) problems.push(`${request.attempts} attempts, more than MAX_ATTEMPTS ${maxAttempts}`);
  if (attempts.length !== request.attempts) problems.push(`attempts ${request.attempts} but ${attempts.length} attempt rows`);
  attempts.forEach((attempt, index) => {
    if (attempt.attempt_number !== index + 1) problems.push(`attempt rows numbered ${attempts.map((a) => a.attempt_number).join(',')}`);
    if (attempt.outcome === 'running') problems.push(`attempt ${attempt.attempt_number} still running`);
    if (request.finished_at && attempt.started_at > request.finished_at) {
      problems.push(`attempt ${attempt.attempt_number} started at ${attempt.started_at.toISOString()}, after the request finished at ${request.finished_at.toISOString()}`);
    }
  });
  const succeeded = attempts.filter((attempt) => attempt.outcome === 'succeeded').length;
  if (request.status === 'completed' && succeeded !== 1) problems.push(`completed with ${succeeded} succeeded attempts`);
  if (request.status === 'failed' && succeeded !== 0) problems.push(`failed with ${succeeded} succeeded attempts`);
  if (request.status === 'completed' && attempts.at(-1)?.outcome !== 'succeeded') problems.push('completed, but its last attempt did not succeed');
  const lastFailure = attempts.filter((attempt) => attempt.outcome === 'failed').at(-1);
  if ((lastFailure?.error_code ?? null) !== request.last_error_code) {
    problems.push(`last_error_code ${request.last_error_code}, but the last failed attempt says ${lastFailure?.error_code ?? null}`);
  }
  return problems;
}

/** The job queue, the worker pools' heartbeats and the lanes not healthy, to explain requests that did not end. */
export async function queueSummary(pool: pg.Pool): Promise<string> {
  const { rows: jobs } = await pool.query<{ task: string; locked_by: string | null; count: number; attempts: number; last_error: string | null }>(
    `select task_identifier as task, locked_by, count(*)::int as count, max(attempts)::int as attempts, max(last_error) as last_error
     from graphile_worker.jobs group by 1, 2 order by 1, 2`,
  );
  const { rows: pools } = await pool.query<{ id: string; seen_ms_ago: number }>(
    `select id, (extract(epoch from now() - last_seen_at) * 1000)::int as seen_ms_ago from gateway.worker_pools order by 1`,
  ).catch(() => ({ rows: [] }));
  const { rows: lanes } = await pool.query<{ id: string; model: string; health: string; probe: string | null }>(
    `select lanes.id, lanes.model, lanes.health, lanes.probe_request_id || ' ' || coalesce(requests.status, 'gone') as probe
     from gateway.lanes left join gateway.requests on requests.id = lanes.probe_request_id
     where lanes.health <> 'healthy' order by lanes.id`,
  );
  const jobText = jobs.map((job) => `${job.count} ${job.task} ${job.locked_by ? `locked by ${job.locked_by}` : 'unlocked'} (attempts up to ${job.attempts}${job.last_error ? `, last error ${JSON.stringify(job.last_error.slice(0, 120))}` : ''})`).join('; ');
  const poolText = pools.map((row) => `${row.id} seen ${row.seen_ms_ago} ms ago`).join('; ');
  const laneText = lanes.map((lane) => `lane ${lane.id} (${lane.model}) ${lane.health}${lane.probe ? `, probe ${lane.probe}` : ''}`).join('; ');
  return `jobs: ${jobText || 'none'}; worker pools: ${poolText || 'none'}; lanes not healthy: ${laneText || 'none'}`;
}
