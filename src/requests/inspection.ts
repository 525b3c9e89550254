// SQL for operators: listings and the views (request_counts, waiting_requests, recent_errors,
// attempt_history), read by `gateway requests` and `gateway stats` (and by psql users
// directly), and the queue that the metrics show (metrics.ts).
import { sql, type Selectable } from 'kysely';
import type { Database, RequestsTable, RequestStatus } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';

export interface RequestSummary {
  id: string;
  project: string;
  mode: KeyMode;
  status: RequestStatus;
  attempts: number;
  last_error_code: string | null;
  model: string;
  created_at: Date;
}

const summaries = (db: Db) =>
  db
    .selectFrom('requests')
    .innerJoin('projects', 'projects.id', 'requests.project_id')
    .select([
      'requests.id',
      'projects.name as project',
      'requests.mode',
      'requests.status',
      'requests.attempts',
      'requests.last_error_code',
      'requests.model',
      'requests.created_at',
    ]);

/** Newest first. */
export async function listRequests(
  db: Db,
  filter: { status?: RequestStatus; project?: string; mode?: KeyMode; limit: number },
): Promise<RequestSummary[]> {
  let query = summaries(db)
    .orderBy('requests.id', 'desc')
    .limit(filter.limit);
  if (filter.status) query = query.where('requests.status', '=', filter.status);
  if (filter.project !== undefined) query = query.where('projects.name', '=', filter.project);
  if (filter.mode) query = query.where('requests.mode', '=', filter.mode);
  return query.execute();
}

export async function findRequestDetail(db: Db, id: string) {
  const request = await summaries(db)
    .select([
      'requests.idempotency_key',
      'requests.api_key_id',
      'requests.updated_at',
      'requests.next_attempt_at',
      'requests.finished_at',
      'requests.result',
      sql<boolean>`requests.body is not null`.as('body_kept'),
    ])
    .where('requests.id', '=', id)
    .executeTakeFirst();
  if (!request) return undefined;
  const attempts = await db
    .selectFrom('request_attempts')
    .select([
      'attempt_number',
      'upstream',
      'outcome',
      'charged',
      'error_code',
      'upstream_status',
      'duration_ms',
      'started_at',
      'finished_at',
      'worker_id',
      'error_detail',
    ])
    .where('request_id', '=', id)
    .orderBy('attempt_number')
    .execute();
  return { request, attempts };
}

export async function stats(db: Db) {
  const [counts, waiting, errors, pools] = await Promise.all([
    sql<{ project: string; mode: KeyMode; status: RequestStatus; requests: string }>`
      select project, mode, status, requests from gateway.request_counts order by project, mode, status
    `.execute(db),
    sql<{ waiting: string; oldest_created_at: Date | null }>`
      select count(*) as waiting, min(created_at) as oldest_created_at from gateway.waiting_requests
    `.execute(db),
    sql<{ error_code: string; mode: KeyMode; failed_attempts: string; requests: string; last_seen_at: Date }>`
      select * from gateway.recent_errors order by failed_attempts desc, error_code
    `.execute(db),
    sql<Selectable<Database['worker_pools']> & { kind: 'pool' | 'worker' }>`
      select id, case when id like 'pool-%' then 'pool' else 'worker' end as kind, hostname, pid, started_at, last_seen_at
      from gateway.worker_pools order by hostname, pid, kind desc
    `.execute(db),
  ]);
  return {
    requests: counts.rows.map((row) => ({ ...row, requests: Number(row.requests) })),
    waiting: {
      requests: Number(waiting.rows[0]?.waiting ?? 0),
      oldest_created_at: waiting.rows[0]?.oldest_created_at ?? null,
    },
    errors_last_hour: errors.rows.map((row) => ({
      ...row,
      failed_attempts: Number(row.failed_attempts),
      requests: Number(row.requests),
    })),
    worker_pools: pools.rows,
  };
}

/** Requests not finished yet, counted by status and mode (only the statuses and modes that have some). */
export async function countUnfinishedByStatus(
  db: Db,
): Promise<(Pick<Selectable<RequestsTable>, 'status' | 'mode'> & { count: number })[]> {
  const { rows } = await sql<Pick<Selectable<RequestsTable>, 'status' | 'mode'> & { count: string }>`
    select status, mode, count(*) as count from gateway.requests
    where finished_at is null
    group by status, mode
  `.execute(db);
  return rows.map((row) => ({ ...row, count: Number(row.count) }));
}

export interface UsageRow {
  /** YYYY-MM-DD, UTC. */
  day: string;
  project: string;
  mode: KeyMode;
  upstream: string;
  model: string;
  requests: number;
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

/** gateway.usage_daily, oldest day first; `since` is a day (YYYY-MM-DD), counted in. */
export async function usageDaily(db: Db, filter: { project?: string; since?: string }): Promise<UsageRow[]> {
  const { rows } = await sql<Record<keyof UsageRow, string>>`
    select to_char(day, 'YYYY-MM-DD') as day, project, mode, upstream, model, requests, prompt_tokens,
           completion_tokens, total_tokens
    from gateway.usage_daily
    where (${filter.project ?? null}::text is null or project = ${filter.project ?? null})
      and (${filter.since ?? null}::date is null or day >= ${filter.since ?? null}::date)
    order by day, project, mode, upstream, model
  `.execute(db);
  return rows.map((row) => ({
    day: row.day,
    project: row.project,
    mode: row.mode as KeyMode,
    upstream: row.upstream,
    model: row.model,
    requests: Number(row.requests),
    prompt_tokens: Number(row.prompt_tokens),
    completion_tokens: Number(row.completion_tokens),
    total_tokens: Number(row.total_tokens),
  }));
}
