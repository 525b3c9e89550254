// createApp(deps): the whole HTTP API as a Koa app, serving the parts it is given (main.ts
// builds them and stops them); it does not listen, so a test can call app.callback() directly.
// Per route, the steps are:
//   authenticate (bearer key) -> [submissions: intake limits] -> readBody (size, media type)
//   -> verify signature -> handler
// createOpsApp(deps): what a worker-only process serves on PORT: health (and metrics, as below).
// createMetricsApp(deps): GET /metrics alone, on METRICS_PORT.
//
// Where /metrics is: on METRICS_PORT when it is set; else on PORT (the API's, or a worker's
// health port) only when METRICS_TOKEN is set, which it then requires; else nowhere. A scrape
// reads the database (the queue gauges), so an open /metrics on the public port is not left to
// anyone.
import Router from '@koa/router';
import Koa from 'koa';
import type pg from 'pg';
import type { Config } from '../config.ts';
import { methodNotAllowed, routeNotFound } from '../errors.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { errorSummary } from '../db/pool.ts';
import type { KeyCache } from '../keys/cache.ts';
import type { KeyReads } from '../keys/reads.ts';
import type { UnchecksummedKeys } from '../keys/unchecksummed.ts';
import type { Intake } from '../requests/intake.ts';
import type { RequestDeps } from '../requests/service.ts';
import { authenticate } from './auth.ts';
import { noBody, readBody } from './body.ts';
import type { GatewayContext, GatewayState, Reply, Step } from './context.ts';
import { errorReply, renderError } from './errors.ts';
import { send } from './reply.ts';
import { verifyRequestSignature } from './signature.ts';
import { createCompletion } from './routes/completions.ts';
import { healthz, metricsRoute, readyz } from './routes/ops.ts';
import { cancelRequest, getRequest } from './routes/requests.ts';

export interface MetricsDeps {
  config: Config;
  metrics: Metrics;
  logger: Logger;
}

export interface OpsDeps extends MetricsDeps {
  pool: pg.Pool;
}

/** The API's parts (requests/service.ts has what each is for), and what auth works with besides the database. */
export interface AppDeps extends OpsDeps, RequestDeps {
  config: Config;
  keys: KeyCache;
  keyReads: KeyReads;
  /** Without it, keys without a checksum are always read. */
  unchecksummed?: UnchecksummedKeys | undefined;
}

export function createApp(deps: AppDeps): Koa<GatewayState> {
  const { app, router } = opsApp(deps);
  const signed = verifyRequestSignature(deps.config, deps.keys);
  const authenticated = authenticate(deps.db, {
    cache: deps.keys,
    reads: deps.keyReads,
    unchecksummed: deps.unchecksummed,
    onUnknown: () => deps.metrics.unknownKeys.inc(),
  });

  router.post(
    '/v1/chat/completions',
    route([authenticated, intakeFirst(deps.intake), readBody(deps.config.maxBodyBytes), signed], createCompletion(deps)),
  );
  router.get('/v1/requests/:id', route([authenticated, signed], getRequest(deps)));
  router.post('/v1/requests/:id/cancel', route([authenticated, noBody(), signed], cancelRequest(deps)));
  return finish(app, router);
}

export function createOpsApp(deps: OpsDeps): Koa<GatewayState> {
  const { app, router } = opsApp(deps);
  return finish(app, router);
}

export function createMetricsApp(deps: MetricsDeps): Koa<GatewayState> {
  const app = new Koa<GatewayState>();
  const router = new Router<GatewayState>();
  router.get('/metrics', metricsRoute(deps.metrics, deps.config.metricsToken));
  app.use(answer(deps.logger, deps.metrics));
  return finish(app, router);
}

/** Whether PORT serves /metrics (see the top of this file). */
const metricsOnMainPort = (config: Pick<Config, 'metricsPort' | 'metricsToken'>): boolean =>
  config.metricsPort === undefined && config.metricsToken !== undefined;

function opsApp(deps: OpsDeps) {
  const app = new Koa<GatewayState>();
  const router = new Router<GatewayState>();
  router.get('/healthz', healthz);
  router.get('/readyz', readyz(deps.pool, deps.logger));
  if (metricsOnMainPort(deps.config)) router.get('/metrics', metricsRoute(deps.metrics, deps.config.metricsToken));
  app.use(answer(deps.logger, deps.metrics));
  return { app, router };
}

function finish(app: Koa<GatewayState>, router: Router<GatewayState>): Koa<GatewayState> {
  app.use(router.routes());
  // A path's other methods: a 405 (501 for a method no route takes) with the methods it takes in
  // Allow, which answer() gives the contract's body; OPTIONS: 200, Allow and no body.
  app.use(router.allowedMethods());
  return app;
}

/**
 * The intake limits of a submission, checked before its body is read with the size its
 * Content-Length announces: a submission they refuse costs no reading, parsing or hashing. The
 * handler checks them again, and counts the submission, once the body is valid.
 */
function intakeFirst(intake: Intake): Step {
  return (ctx) => intake.checkSubmission(ctx.state.auth, Number(ctx.get('content-length')) || 0);
}

/** Runs a route's steps in order, then its handler. */
function route<T extends Koa.Middleware<GatewayState, any>>(steps: Step[], handler: T): T {
  return (async (ctx: GatewayContext, next: Koa.Next) => {
    for (const step of steps) await step(ctx);
    return handler(ctx, next);
  }) as T;
}

/**
 * Around every request: failures rendered in the contract's error shape (an unmatched route is
 * a 404 route_not_found, a method its path does not take a 405 method_not_allowed), then one log line and the HTTP metrics: method, route pattern,
 * status and duration; no headers, no bodies, no ids.
 */
function answer(logger: Logger, metrics: Metrics): Koa.Middleware<GatewayState> {
  const log = logger.child({ component: 'http' });
  const record = (method: string, route: string, status: number, started: number) => {
    const seconds = (performance.now() - started) / 1000;
    metrics.httpRequests.inc({ method, route, status: String(status) });
    metrics.httpDuration.observe({ method, route }, seconds);
    log.info({ method, route, status, ms: Math.round(seconds * 10_000) / 10 });
  };
  return async (ctx, next) => {
    const started = performance.now();
    try {
      await next();
      if (ctx.state.later) return answerLater(ctx, ctx.state.later, started, logger, record);
      if (ctx.status === 404 && ctx.body == null) throw routeNotFound();
      if ((ctx.status === 405 || ctx.status === 501) && ctx.body == null) throw methodNotAllowed();
    } catch (caught) {
      renderError(ctx, caught, logger);
    }
    record(ctx.method, matchedRoute(ctx), ctx.status, started);
  };
}

const matchedRoute = (ctx: GatewayContext) => (ctx as { _matchedRoute?: string })._matchedRoute ?? 'unmatched';

/**
 * A handler that answers later (a wait=true request still waiting) ends the middleware chain
 * at once: Koa sends nothing (ctx.respond = false) and lets go of the context, and the answer is
 * written here when `later` settles. Until then the request holds its connection, the wait,
 * and the few values below: not the context, the request's body or the chain's frames.
 */
function answerLater(
  ctx: GatewayContext,
  later: Promise<Reply>,
  started: number,
  logger: Logger,
  record: (method: string, route: string, status: number, started: number) => void,
): void {
  const { method, path, res } = ctx;
  const route = matchedRoute(ctx);
  ctx.respond = false;
  // Koa watches every response with on-finished until it ends, and that holds on to the
  // context. 'end' (never emitted by a ServerResponse) makes on-finished let go now, and calls
  // Koa's ctx.onerror(null), which does nothing. Koa 3 has no supported way to do this (nor
  // on-finished a way to remove its listener): test/http/held-contexts.test.ts pins that it works.
  res.emit('end');
  const finish = (reply: Reply | undefined, caught?: unknown) => {
    try {
      reply ??= errorReply(caught, logger, method, path);
      send(res, reply);
      record(method, route, reply.status, started);
    } catch (error) {
      logger.error({ method, path, err: errorSummary(error) }, 'could not send an answer');
    }
  };
  later.then(finish, (caught: unknown) => finish(undefined, caught));
}
