// gateway usage: completed requests and their tokens per day, project, mode, upstream and model
// (gateway.usage_daily).
import type { Db } from '../db/pool.ts';
import { usageDaily } from '../requests/inspection.ts';
import { table } from './output.ts';
import * as v from 'valibot';
import type { AdminCommand } from '../main.ts';
import { parse } from './args.ts';

async function usageCommand(db: Db, options: { project?: string; since?: string; json: boolean }): Promise<string> {
  const rows = await usageDaily(db, options);
  if (options.json) return JSON.stringify(rows);
  if (rows.length === 0) return 'No completed requests.';
  return table(rows, ['day', 'project', 'mode', 'upstream', 'model', 'requests', 'prompt_tokens', 'completion_tokens', 'total_tokens']);
}

const Day = v.pipe(
  v.string(),
  v.regex(/^\d{4}-\d{2}-\d{2}$/, '--since must be a day, YYYY-MM-DD'),
  v.check(isDay, '--since must be a day, YYYY-MM-DD, of year 1 or after'),
);

/** A day of the calendar from 0001-01-01 on: Postgres's dates have no year 0, where JavaScript's do. */
function isDay(text: string): boolean {
  const date = new Date(`${text}T00:00:00Z`);
  return !Number.isNaN(date.getTime()) && date.getUTCFullYear() >= 1 && date.toISOString().startsWith(text);
}

/** gateway usage, from its arguments. */
export function parseUsageCommand(args: string[]): AdminCommand {
  const { values } = parse(args, {
    project: { type: 'string' },
    since: { type: 'string' },
    json: { type: 'boolean', default: false },
  });
  const since = values.since === undefined ? undefined : v.parse(Day, values.since);
  return (db) =>
    usageCommand(db, {
      json: values.json!,
      ...(values.project !== undefined ? { project: values.project } : {}),
      ...(since ? { since } : {}),
    });
}
