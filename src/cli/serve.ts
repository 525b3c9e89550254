// gateway serve [--role all|api|worker] | start: what runs them is main.ts's.
import * as v from 'valibot';
import type { Config } from '../config.ts';
import { serve, start } from '../main.ts';
import { parse } from './args.ts';
import { CommandError } from './output.ts';

export function serveCommand(config: Config, args: string[]): Promise<void> {
  const { values } = parse(args, { role: { type: 'string', default: 'all' } });
  const role = v.parse(v.picklist(['all', 'api', 'worker'], '--role must be all, api or worker'), values.role);
  if (config.databaseUrl === undefined) {
    throw new CommandError('DATABASE_URL is not set. (`make run` starts the gateway on an embedded Postgres instead.)');
  }
  return serve(config, role, config.databaseUrl);
}

export function startCommand(config: Config, args: string[]): Promise<void> {
  parse(args, {});
  return start(config);
}
