// GET /v1/requests/{id} (CONTRACT.md section 3).
import type { RouterMiddleware } from '@koa/router';
import { lookup, type RequestDeps } from '../../requests/service.ts';
import type { GatewayState } from '../context.ts';

export function getRequest(deps: Pick<RequestDeps, 'db'>): RouterMiddleware<GatewayState> {
  return async (ctx) => {
    const record = await lookup(deps, ctx.state.auth, ctx.params.id ?? '');
    ctx.body = {
      id: record.id,
      status: record.status,
      attempts: record.attempts,
      created_at: record.created_at.toISOString(),
      updated_at: record.updated_at.toISOString(),
      last_error_code: record.last_error_code,
      ...(record.status === 'completed' ? { result: record.result } : {}),
    };
  };
}
