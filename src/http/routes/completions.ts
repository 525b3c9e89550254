// POST /v1/chat/completions (docs/api.md, "Submitting a request").
import type { Middleware } from 'koa';
import { parseSubmission } from '../../requests/schemas.ts';
import { submit, type RequestDeps, type SubmitOutcome } from '../../requests/service.ts';
import { parseJson } from '../body.ts';
import type { GatewayState, Reply } from '../context.ts';
import { setReply } from '../reply.ts';

export function createCompletion(deps: RequestDeps): Middleware<GatewayState> {
  return async (ctx) => {
    const body = ctx.state.body!;
    const submission = parseSubmission(parseJson(body));
    const submitted = await submit(deps, ctx.state.auth, submission, { signature: ctx.state.signature, bodyBytes: body.length });
    if (submitted.kind !== 'waiting') {
      setReply(ctx, replyOf(submitted));
      return;
    }
    // Still waiting: answered later, outside the middleware chain (app.ts). If the client hangs
    // up first, the wait stops (the request runs on).
    const response = ctx.res;
    if (response.destroyed) submitted.abort();
    else response.on('close', () => submitted.abort());
    ctx.state.later = submitted.outcome.then(replyOf);
  };
}

function replyOf(outcome: SubmitOutcome): Reply {
  if (outcome.kind === 'completed') return { status: 200, body: outcome.result, replayed: outcome.replayed };
  return {
    status: 202,
    body: {
      id: outcome.id,
      object: 'chat.completion.async',
      status: outcome.status,
      created: Math.floor(outcome.created.getTime() / 1000),
    },
    replayed: outcome.replayed,
  };
}
