// createApp serves what it is given without listening: requests are handed to app.callback()
// as node:http objects, with no server and no socket, against a real database.
import { createHash } from 'node:crypto';
import http from 'node:http';
import { Socket } from 'node:net';
import { Writable } from 'node:stream';
import t from 'tap';
import { loadConfig } from '../../src/config.ts';
import { Listener } from '../../src/db/listener.ts';
import { createDb, createPool } from '../../src/db/pool.ts';
import { createApp } from '../../src/http/app.ts';
import { KeyCache } from '../../src/keys/cache.ts';
import { KeyReads } from '../../src/keys/reads.ts';
import { NO_INTAKE_LIMITS } from '../../src/requests/intake.ts';
import { QueueRouter } from '../../src/lanes/routing.ts';
import { createLogger } from '../../src/logger.ts';
import { Metrics } from '../../src/metrics.ts';
import { InsertBatcher } from '../../src/requests/insert-batcher.ts';
import { createRequestReads } from '../../src/requests/reads.ts';
import { Waiters } from '../../src/requests/waiters.ts';
import { createTestDatabase } from '../helpers/database.ts';
import { TEST_SETTINGS } from '../helpers/gateway.ts';

interface Answer {
  status: number;
  body: unknown;
}

/** One request through the app's handler: what it wrote to the response is parsed back. */
function dispatch(handler: http.RequestListener, method: string, url: string, headers: http.IncomingHttpHeaders = {}): Promise<Answer> {
  const request = new http.IncomingMessage(new Socket());
  request.method = method;
  request.url = url;
  request.headers = headers;
  request.push(null);
  const response = new http.ServerResponse(request);
  const written: Buffer[] = [];
  const wire = new Writable({
    write(chunk: Buffer, _encoding, done) {
      written.push(chunk);
      done();
    },
  });
  response.assignSocket(wire as unknown as Socket);
  return new Promise((resolve, reject) => {
    response.once('finish', () => {
      const text = Buffer.concat(written).toString('utf8');
      const body = text.slice(text.indexOf('\r\n\r\n') + 4);
      try {
        resolve({ status: response.statusCode, body: JSON.parse(body) });
      } catch (error) {
        reject(error);
      }
    });
    handler(request, response);
  });
}

t.test('the app answers health, unknown routes and unauthenticated calls without listening', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  const config = loadConfig({
    ...TEST_SETTINGS,
    SECRET_ENCRYPTION_KEY: createHash('sha256').update(`test key for ${databaseUrl}`).digest('base64'),
    DATABASE_URL: databaseUrl,
  });
  const logger = createLogger({ logLevel: 'silent' });
  const pool = createPool(databaseUrl, { max: 2, applicationName: 'gateway-test', logger });
  t.teardown(() => pool.end());
  const db = createDb(pool);
  const listener = new Listener(databaseUrl, logger);
  const metrics = new Metrics();
  const app = createApp({
    config,
    pool,
    db,
    inserts: new InsertBatcher(db),
    reads: createRequestReads(db),
    waiters: new Waiters(listener),
    keys: new KeyCache(listener),
    keyReads: new KeyReads(db),
    queues: new QueueRouter(db, config),
    intake: NO_INTAKE_LIMITS,
    metrics,
    logger,
  });
  const handler = app.callback();

  t.same(await dispatch(handler, 'GET', '/healthz'), { status: 200, body: { status: 'ok' } });

  const unknown = await dispatch(handler, 'GET', '/v1/nothing-here');
  t.equal(unknown.status, 404);
  t.match(unknown.body, { error: { code: 'route_not_found' } });

  const anonymous = await dispatch(handler, 'POST', '/v1/chat/completions', { 'content-type': 'application/json' });
  t.equal(anonymous.status, 401);
  t.match(anonymous.body, { error: { code: 'missing_api_key' } });

  // Well formed, and looked up in the database: not there.
  const unknownKey = await dispatch(handler, 'GET', '/v1/requests/req_0', { authorization: `Bearer svc_test_${'a'.repeat(32)}` });
  t.equal(unknownKey.status, 401);
  t.match(unknownKey.body, { error: { code: 'invalid_api_key' } });
  t.equal((await metrics.unknownKeys.get()).values[0]?.value, 1, 'an unknown key is counted');
});
