// createApp(deps): the whole HTTP API as a Koa app, built without listening so tests and
// main.ts wire it the same way. Per route, the chain is:
//   authenticate (bearer key) -> readBody (size, media type) -> verify signature -> handler
import Router from '@koa/router';
import Koa from 'koa';
import type pg from 'pg';
import type { Config } from '../config.ts';
import type { Db } from '../db/pool.ts';
import { methodNotAllowed } from '../errors.ts';
import type { KeyCache } from '../keys/cache.ts';
import type { Logger } from '../logger.ts';
import { InsertBatcher } from '../requests/insert-batcher.ts';
import type { Waiters } from '../requests/waiters.ts';
import { authenticate } from './auth.ts';
import { readBody } from './body.ts';
import type { GatewayState } from './context.ts';
import { renderErrors } from './errors.ts';
import { verifyRequestSignature } from './signature.ts';
import { createCompletion } from './routes/completions.ts';
import { healthz, readyz } from './routes/health.ts';
import { getRequest } from './routes/requests.ts';

export interface AppDeps {
  config: Config;
  pool: pg.Pool;
  db: Db;
  waiters: Waiters;
  keys: KeyCache;
  logger: Logger;
}

export function createApp(deps: AppDeps): Koa<GatewayState> {
  const app = new Koa<GatewayState>();
  const router = new Router<GatewayState>();
  const requestDeps = {
    db: deps.db,
    inserts: new InsertBatcher(deps.db, { maxInFlight: Math.max(1, Math.floor(deps.config.databasePoolSize / 3)) }),
    waiters: deps.waiters,
    config: deps.config,
  };
  const signed = verifyRequestSignature(deps.config, deps.keys);
  const authenticated = authenticate(deps.db, deps.keys);

  router.get('/healthz', healthz);
  router.get('/readyz', readyz(deps.pool));
  router.post(
    '/v1/chat/completions',
    authenticated,
    readBody(deps.config.maxBodyBytes),
    signed,
    createCompletion(requestDeps),
  );
  router.get('/v1/requests/:id', authenticated, signed, getRequest(requestDeps));

  app.use(accessLog(deps.logger));
  app.use(renderErrors(deps.logger));
  app.use(router.routes());
  app.use(router.allowedMethods({ throw: true, methodNotAllowed, notImplemented: methodNotAllowed }));
  return app;
}

/** One line per request: method, route pattern, status and duration; no headers, no bodies. */
function accessLog(logger: Logger): Koa.Middleware {
  const log = logger.child({ component: 'http' });
  return async (ctx, next) => {
    const started = performance.now();
    try {
      await next();
    } finally {
      log.info({
        method: ctx.method,
        route: (ctx as { _matchedRoute?: string })._matchedRoute ?? null,
        status: ctx.status,
        ms: Math.round((performance.now() - started) * 10) / 10,
      });
    }
  };
}
