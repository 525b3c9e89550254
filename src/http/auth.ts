// Bearer authentication: the first thing checked, before the body is read.
import type { Middleware } from 'koa';
import type { Db } from '../db/pool.ts';
import type { KeyCache } from '../keys/cache.ts';
import { authenticate as authenticateKey } from '../keys/service.ts';
import type { GatewayState } from './context.ts';

export function authenticate(db: Db, cache: KeyCache): Middleware<GatewayState> {
  return async (ctx, next) => {
    ctx.state.auth = await authenticateKey(db, ctx.get('authorization') || undefined, cache);
    await next();
  };
}
