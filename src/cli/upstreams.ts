// gateway upstreams: where live requests go (UPSTREAMS_FILE, as this process reads it) and what
// each lane holds now, and its health (gateway.lane_states).
import type { Db } from '../db/pool.ts';
import { laneStates } from '../lanes/repository.ts';
import type { Upstream } from '../upstream/upstreams.ts';
import { table } from './output.ts';
import type { AdminCommand } from '../main.ts';
import { parse } from './args.ts';

async function upstreamsCommand(db: Db, upstreams: readonly Upstream[], options: { json: boolean }): Promise<string> {
  const lanes = await laneStates(db);
  const configured = upstreams.map((upstream) => ({
    name: upstream.name,
    base_url: upstream.baseUrl,
    models: upstream.models,
    renames: upstream.renames,
    max_concurrent: upstream.limits.maxConcurrent ?? null,
    requests_per_minute: upstream.limits.requestsPerMinute ?? null,
    tokens_per_minute: upstream.limits.tokensPerMinute ?? null,
  }));
  if (options.json) return JSON.stringify({ upstreams: configured, lanes });
  return [
    'Upstreams (a model\'s deployments, preferred in this order; model=name: the upstream\'s own name for it)',
    table(
      configured.map((upstream) => ({
        ...upstream,
        models: upstream.models.map((model) => (Object.hasOwn(upstream.renames, model) ? `${model}=${upstream.renames[model]}` : model)).join(' '),
      })),
      ['name', 'base_url', 'models', 'max_concurrent', 'requests_per_minute', 'tokens_per_minute'],
    ),
    '',
    'Lanes',
    lanes.length === 0
      ? '  (none yet: a lane appears with its first request)'
      : table(lanes, [
          'id',
          'mode',
          'model',
          'deployment',
          'upstream',
          'health',
          'waiting',
          'running',
          'max_concurrent',
          'requests_per_minute',
          'tokens_per_minute',
          'paused_until',
          'next_probe_at',
          'last_error',
        ]),
  ].join('\n');
}

/** gateway upstreams, from its arguments. */
export function parseUpstreamsCommand(args: string[]): AdminCommand {
  const { values } = parse(args, { json: { type: 'boolean', default: false } });
  return (db, { config }) => upstreamsCommand(db, config.upstreams, { json: values.json! });
}
