// GET /healthz: the process answers. GET /readyz: the database answers and its schema is the
// one this code expects. Neither needs a key.
import type { Middleware } from 'koa';
import type pg from 'pg';
import { schemaVersion } from '../../db/migrate.ts';
import { serviceUnavailable } from '../../errors.ts';

export const healthz: Middleware = (ctx) => {
  ctx.body = { status: 'ok' };
};

export function readyz(pool: pg.Pool): Middleware {
  return async (ctx) => {
    const { applied, expected } = await schemaVersion(pool);
    if (applied !== expected) {
      throw serviceUnavailable(5, `The database schema is at migration ${applied}; this gateway expects ${expected}.`);
    }
    ctx.body = { status: 'ready', schema: applied };
  };
}
