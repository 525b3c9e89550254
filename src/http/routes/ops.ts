// Routes for operators: GET /healthz and GET /readyz, served by every process on PORT (a
// worker-only process serves only these), and GET /metrics (where: see ../app.ts), behind
// METRICS_TOKEN when it is set. Neither probe says more than ready or not: no versions.
import { timingSafeEqual } from 'node:crypto';
import type { Middleware } from 'koa';
import type pg from 'pg';
import { schemaVersion } from '../../db/migrate.ts';
import { authenticationError, serviceUnavailable } from '../../errors.ts';
import type { Logger } from '../../logger.ts';
import type { Metrics } from '../../metrics.ts';

export const healthz: Middleware = (ctx) => {
  ctx.body = { status: 'ok' };
};

/**
 * The database answers and its schema is the one this code expects. Which schema it is, is the
 * operator's business: the log says, the answer does not.
 */
export function readyz(pool: pg.Pool, logger: Logger): Middleware {
  const log = logger.child({ component: 'readyz' });
  return async (ctx) => {
    const { applied, expected } = await schemaVersion(pool);
    if (applied !== expected) {
      log.warn({ applied, expected }, 'not ready: the database schema is not the one this gateway expects; run `gateway migrate`');
      throw serviceUnavailable(5, 'The gateway is not ready; try again later.');
    }
    ctx.body = { status: 'ready' };
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
