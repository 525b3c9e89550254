// GET /v1/requests/{id} and POST /v1/requests/{id}/cancel (docs/api.md, "Looking up a request"
// and "Cancelling a request"): both answer the request record.
import type { RouterMiddleware } from '@koa/router';
import { recordBody } from '../../requests/record.ts';
import { cancel, lookup, type RequestDeps } from '../../requests/service.ts';
import type { GatewayState } from '../context.ts';
import { setJsonBody } from '../reply.ts';

export function getRequest(deps: Pick<RequestDeps, 'reads' | 'intake'>): RouterMiddleware<GatewayState> {
  return async (ctx) => {
    const row = await lookup(deps, ctx.state.auth, ctx.params.id ?? '');
    setJsonBody(ctx, recordBody(row));
  };
}

export function cancelRequest(deps: Pick<RequestDeps, 'db' | 'intake' | 'metrics'>): RouterMiddleware<GatewayState> {
  return async (ctx) => {
    const row = await cancel(deps, ctx.state.auth, ctx.params.id ?? '', { signature: ctx.state.signature });
    setJsonBody(ctx, recordBody(row));
  };
}
