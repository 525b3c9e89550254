// POST /v1/chat/completions (CONTRACT.md section 2).
import type { ServerResponse } from 'node:http';
import type { Middleware } from 'koa';
import { parseSubmission } from '../../requests/schemas.ts';
import { submit, type RequestDeps } from '../../requests/service.ts';
import { parseJson } from '../body.ts';
import type { GatewayState } from '../context.ts';

export function createCompletion(deps: RequestDeps): Middleware<GatewayState> {
  return async (ctx) => {
    const submission = parseSubmission(parseJson(ctx.state.body!));
    const outcome = await submit(deps, ctx.state.auth, submission, {
      signature: ctx.state.signature,
      ...(submission.wait ? { signal: hangUp(ctx.res) } : {}),
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

/** Aborts if the client hangs up before it is answered: its wait stops (the request runs on). */
function hangUp(response: ServerResponse): AbortSignal {
  const controller = new AbortController();
  response.once('close', () => {
    if (!response.writableFinished) controller.abort();
  });
  return controller.signal;
}
