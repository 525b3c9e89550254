// Renders every failure in the contract's error shape. ApiErrors are shown as they are; a lost
// database becomes a 503 with retry-after; anything else is logged and becomes a bare 500.
import type { ParameterizedContext } from 'koa';
import { isDatabaseUnavailable, errorSummary } from '../db/pool.ts';
import { ApiError, internalError, serviceUnavailable } from '../errors.ts';
import type { Logger } from '../logger.ts';
import type { Reply } from './context.ts';
import { setReply } from './reply.ts';

export function renderError(ctx: ParameterizedContext, caught: unknown, logger: Logger): void {
  setReply(ctx, errorReply(caught, logger, ctx.method, ctx.path));
}

/** The error as a Reply: what renderError sets, and what an answer sent outside Koa sends. */
export function errorReply(caught: unknown, logger: Logger, method: string, path: string): Reply {
  const error = toApiError(caught, logger, method, path);
  return {
    status: error.status,
    body: error.toBody(),
    ...(error.retryAfter !== undefined ? { headers: { 'retry-after': String(error.retryAfter) } } : {}),
  };
}

function toApiError(error: unknown, logger: Logger, method: string, path: string): ApiError {
  if (error instanceof ApiError) return error;
  if (isDatabaseUnavailable(error)) {
    // (A caller that waited too long for a pooled connection lands here too: overload, which the
    // same 503 and retry-after also answer well.)
    logger.warn({ method, path, err: errorSummary(error) }, 'database unreachable, or no pooled connection free in time');
    return serviceUnavailable();
  }
  // The stack goes to the log; the client learns only that it was our fault. Only the error's
  // name, code, message and stack are logged: a Postgres error's detail can quote row values.
  logger.error({ method, path, err: { ...errorSummary(error), stack: (error as Error)?.stack } }, 'unhandled error');
  return internalError();
}
