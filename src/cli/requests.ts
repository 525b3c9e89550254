// gateway requests show | list, and gateway stats: the service's state, as tables or --json.
import type { RequestStatus } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';
import { findRequestDetail, listRequests, stats } from '../requests/inspection.ts';
import { CommandError, printable, table } from './output.ts';
import * as v from 'valibot';
import type { AdminCommand } from '../main.ts';
import { parse, UsageError } from './args.ts';

async function showRequestCommand(db: Db, id: string, options: { json: boolean }): Promise<string> {
  const detail = await findRequestDetail(db, id);
  if (!detail) throw new CommandError(`No request with id ${id}.`);
  if (options.json) return JSON.stringify(detail);
  const { request, attempts } = detail;
  const fields: [string, unknown][] = [
    ['project', request.project],
    ['mode', request.mode],
    ['status', request.status],
    ['attempts', request.attempts],
    ['last_error_code', request.last_error_code],
    ['model', request.model],
    ['idempotency_key', request.idempotency_key],
    ['api_key_id', request.api_key_id],
    ['created_at', request.created_at],
    ['updated_at', request.updated_at],
    ['next_attempt_at', request.next_attempt_at],
    ['finished_at', request.finished_at],
    ['body', request.body_kept ? 'kept' : 'dropped by retention'],
  ];
  const width = Math.max(...fields.map(([name]) => name.length));
  const lines = [`Request ${request.id}`, ''];
  for (const [name, value] of fields) {
    lines.push(`  ${name.padEnd(width)}  ${value instanceof Date ? value.toISOString() : printable(String(value ?? ''))}`);
  }
  lines.push('', 'Attempts', '');
  lines.push(
    attempts.length === 0
      ? '  (none yet)'
      : table(
          attempts.map((attempt) => ({ '#': attempt.attempt_number, ...attempt })),
          ['#', 'upstream', 'outcome', 'charged', 'error_code', 'upstream_status', 'duration_ms', 'started_at', 'finished_at', 'error_detail'],
        ),
  );
  return lines.join('\n');
}

async function listRequestsCommand(
  db: Db,
  options: { status?: RequestStatus; project?: string; mode?: KeyMode; limit: number; json: boolean },
): Promise<string> {
  const rows = await listRequests(db, options);
  if (options.json) return JSON.stringify(rows);
  if (rows.length === 0) return 'No requests.';
  return table(rows, ['id', 'project', 'mode', 'status', 'attempts', 'last_error_code', 'model', 'created_at']);
}

async function statsCommand(db: Db, options: { json: boolean }): Promise<string> {
  const state = await stats(db);
  if (options.json) return JSON.stringify(state);
  const waitingFor = state.waiting.oldest_created_at
    ? ` (the oldest accepted ${Math.round((Date.now() - state.waiting.oldest_created_at.getTime()) / 1000)} s ago)`
    : '';
  return [
    'Requests by project, mode and status',
    state.requests.length === 0 ? '  (none)' : table(state.requests, ['project', 'mode', 'status', 'requests']),
    '',
    `Waiting (queued, processing or retrying): ${state.waiting.requests}${waitingFor}`,
    '',
    'Failed attempts in the last hour',
    state.errors_last_hour.length === 0
      ? '  (none)'
      : table(state.errors_last_hour, ['error_code', 'mode', 'failed_attempts', 'requests', 'last_seen_at']),
    '',
    'Workers (each process, and its graphile-worker pool)',
    state.worker_pools.length === 0
      ? '  (none running)'
      : table(state.worker_pools, ['id', 'kind', 'hostname', 'pid', 'started_at', 'last_seen_at']),
  ].join('\n');
}

/** gateway requests show | list, from its arguments. */
export function parseRequestsCommand(args: string[]): AdminCommand {
  const [subcommand, ...rest] = args;
  switch (subcommand) {
    case 'show': {
      const { values, positionals } = parse(rest, { json: { type: 'boolean', default: false } }, true);
      if (positionals.length !== 1) throw new UsageError('requests show needs exactly one request id.');
      return (db) => showRequestCommand(db, positionals[0]!, { json: values.json! });
    }
    case 'list': {
      const { values } = parse(rest, {
        status: { type: 'string' },
        project: { type: 'string' },
        mode: { type: 'string' },
        limit: { type: 'string', default: '20' },
        json: { type: 'boolean', default: false },
      });
      const filter = v.parse(
        v.object({
          status: v.optional(v.picklist(['queued', 'processing', 'retrying', 'completed', 'failed', 'cancelled'], '--status must be queued, processing, retrying, completed, failed or cancelled')),
          project: v.optional(v.string()),
          mode: v.optional(v.picklist(['live', 'test'], '--mode must be live or test')),
          limit: v.pipe(v.string(), v.regex(/^\d+$/, '--limit must be a whole number'), v.transform(Number), v.minValue(1, '--limit must be at least 1'), v.maxValue(10_000, '--limit is at most 10000')),
        }),
        values,
      );
      return (db) =>
        listRequestsCommand(db, {
          limit: filter.limit,
          json: values.json!,
          ...(filter.status ? { status: filter.status } : {}),
          ...(filter.project !== undefined ? { project: filter.project } : {}),
          ...(filter.mode ? { mode: filter.mode } : {}),
        });
    }
    default:
      throw new UsageError('requests takes show or list.');
  }
}

/** gateway stats, from its arguments. */
export function parseStatsCommand(args: string[]): AdminCommand {
  const { values } = parse(args, { json: { type: 'boolean', default: false } });
  return (db) => statsCommand(db, { json: values.json! });
}
