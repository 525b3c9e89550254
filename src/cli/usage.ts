// gateway usage: completed requests and their tokens per day, project, mode, upstream and model
// (gateway.usage_daily).
import type { Db } from '../db/pool.ts';
import { usageDaily } from '../requests/inspection.ts';
import { table } from './output.ts';

export async function usageCommand(db: Db, options: { project?: string; since?: string; json: boolean }): Promise<string> {
  const rows = await usageDaily(db, options);
  if (options.json) return JSON.stringify(rows);
  if (rows.length === 0) return 'No completed requests.';
  return table(rows, ['day', 'project', 'mode', 'upstream', 'model', 'requests', 'prompt_tokens', 'completion_tokens', 'total_tokens']);
}
