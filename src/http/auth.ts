// Bearer authentication: the first thing checked, before the body is read.
import type { Db } from '../db/pool.ts';
import { authenticate as authenticateKey, type KeyChecks } from '../keys/service.ts';
import type { Step } from './context.ts';

export function authenticate(db: Db, checks: KeyChecks): Step {
  return async (ctx) => {
    ctx.state.auth = await authenticateKey(db, ctx.get('authorization') || undefined, checks);
  };
}
