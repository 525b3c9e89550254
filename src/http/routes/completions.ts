// POST /v1/chat/completions (CONTRACT.md section 2).
import type { Middleware } from 'koa';
import { parseSubmission } from '../../requests/schemas.ts';
import { submit, type RequestDeps } from '../../requests/service.ts';
import { parseJson } from '../body.ts';
import type { GatewayState } from '../context.ts';

export function createCompletion(deps: RequestDeps): Middleware<GatewayState> {
  return async (ctx) => {
    const submission = parseSubmission(parseJson(ctx.state.body!));
    // A client that hangs up stops its wait; its request runs on regardless.
    const disconnected = new AbortController();
    ctx.res.once('close', () => disconnected.abort());

    const outcome = await submit(deps, ctx.state.auth, submission, {
      signature: ctx.state.signature,
      signal: disconnected.signal,
    });

    if (outcome.replayed) ctx.set('Idempotent-Replayed', 'true');
    if (outcome.kind === 'completed') {
      ctx.status = 200;
      ctx.type = 'application/json';
      ctx.body = outcome.result;
    } else {
      ctx.status = 202;
      ctx.body = {
        id: outcome.id,
        object: 'chat.completion.async',
        status: outcome.status,
        created: Math.floor(outcome.created.getTime() / 1000),
      };
    }
  };
}
