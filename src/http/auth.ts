// Bearer authentication: the first thing checked, before the body is read.
import type { Db } from '../db/pool.ts';
import type { KeyCache } from '../keys/cache.ts';
import { authenticate as authenticateKey } from '../keys/service.ts';
import type { Step } from './context.ts';

/** `onUnknown`: told of each well-formed key that is not there (unknown or revoked). */
export function authenticate(db: Db, cache: KeyCache, onUnknown?: () => void): Step {
  return async (ctx) => {
    ctx.state.auth = await authenticateKey(db, ctx.get('authorization') || undefined, cache, onUnknown);
  };
}
