// GET /v1/requests/{id} (CONTRACT.md section 3).
import type { RouterMiddleware } from '@koa/router';
import { lookup, type RequestDeps } from '../../requests/service.ts';
import type { GatewayState } from '../context.ts';

export function getRequest(deps: Pick<RequestDeps, 'reads' | 'intake'>): RouterMiddleware<GatewayState> {
  return async (ctx) => {
    const row = await lookup(deps, ctx.state.auth, ctx.params.id ?? '');
    const record = JSON.stringify({
      id: row.id,
      status: row.status,
      attempts: row.attempts,
      created_at: row.created_at.toISOString(),
      updated_at: row.updated_at.toISOString(),
      last_error_code: row.last_error_code,
    });
    ctx.type = 'application/json';
    // The result is stored JSON text: spliced in as it is, not parsed and written out again.
    ctx.body = row.status === 'completed' && row.result !== null ? `${record.slice(0, -1)},"result":${row.result}}` : record;
  };
}
