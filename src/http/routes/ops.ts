// Routes for operators, served by every process (a worker-only process serves only these):
// GET /healthz, GET /readyz, GET /metrics (behind METRICS_TOKEN when it is set).
import { timingSafeEqual } from 'node:crypto';
import type { Middleware } from 'koa';
import type pg from 'pg';
import { schemaVersion } from '../../db/migrate.ts';
import { authenticationError, serviceUnavailable } from '../../errors.ts';
import type { Metrics } from '../../metrics.ts';

export const healthz: Middleware = (ctx) => {
  ctx.body = { status: 'ok' };
};

/** The database answers and its schema is the one this code expects. */
export function readyz(pool: pg.Pool): Middleware {
  return async (ctx) => {
    const { applied, expected } = await schemaVersion(pool);
    if (applied !== expected) {
      throw serviceUnavailable(5, `The database schema is at migration ${applied}; this gateway expects ${expected}.`);
    }
    ctx.body = { status: 'ready', schema: applied };
  };
}

export function metricsRoute(metrics: Metrics, token: string | undefined): Middleware {
  const expected = token === undefined ? undefined : Buffer.from(`Bearer ${token}`);
  return async (ctx) => {
    if (expected) {
      const given = Buffer.from(ctx.get('authorization'));
      if (given.length === 0) throw authenticationError('missing_api_key', 'Send the metrics token: "Authorization: Bearer <METRICS_TOKEN>".');
      if (given.length !== expected.length || !timingSafeEqual(given, expected)) {
        throw authenticationError('invalid_api_key', 'The metrics token is not valid.');
      }
    }
    ctx.type = metrics.contentType;
    ctx.body = await metrics.render();
  };
}
