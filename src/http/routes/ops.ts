// Routes for operators: GET /healthz and GET /readyz, served by every process on PORT (a
// worker-only process serves only these), and GET /metrics (where: see ../app.ts), behind
// METRICS_TOKEN when it is set. Neither probe says more than ready or not: no versions.
import { timingSafeEqual } from 'node:crypto';
import type { Middleware } from 'koa';
import type pg from 'pg';
import { schemaVersion } from '../../db/migrate.ts';
import { errorSummary } from '../../db/pool.ts';
import { authenticationError, serviceUnavailable } from '../../errors.ts';
import type { Logger } from '../../logger.ts';
import type { Metrics } from '../../metrics.ts';
import { sharedRead } from '../../shared-read.ts';
import { setJsonBody } from '../reply.ts';

export const healthz: Middleware = (ctx) => {
  setJsonBody(ctx, { status: 'ok' });
};

/** How often /readyz looks at the database at most, whoever asks and however often. */
const READYZ_LOOK_EVERY_MS = 1_000;

/**
 * The database answers and its schema is the one this code expects. Which schema it is, is the
 * operator's business: the log says, the answer does not.
 *
 * Every call is answered from the last look, at most READYZ_LOOK_EVERY_MS old: one look at a
 * time (a listing of sql/ and two statements), shared by the calls that come meanwhile, so a
 * flood of probes costs the pool at most one look a second. A failed look (the database
 * unreachable, or no pooled connection free in time under load) is kept as long: not ready,
 * like a schema behind, whatever the failure. The log says why once per look.
 */
export function readyz(pool: pg.Pool, logger: Logger): Middleware {
  const log = logger.child({ component: 'readyz' });
  const look = sharedRead(async (): Promise<{ ready: boolean }> => {
    try {
      const { applied, expected } = await schemaVersion(pool);
      if (applied !== expected) {
        log.warn({ applied, expected }, 'not ready: the database schema is not the one this gateway expects; run `gateway migrate`');
      }
      return { ready: applied === expected };
    } catch (failure) {
      log.warn({ err: errorSummary(failure) }, 'not ready: the database could not be read');
      return { ready: false };
    }
  }, READYZ_LOOK_EVERY_MS);
  return async (ctx) => {
    const { ready } = await look();
    if (!ready) throw serviceUnavailable(5, 'The gateway is not ready; try again later.');
    setJsonBody(ctx, { status: 'ready' });
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
