// The HTTP surface around the two endpoints: health checks, unknown routes and methods, and
// a 500 that reveals nothing.
import t from 'tap';
import { listMigrations } from '../src/db/migrate.ts';
import { startTestGateway } from './helpers/gateway.ts';
import { clientFor, send, userMessage } from './helpers/http.ts';

t.test('healthz and readyz need no key; readyz says ready or not, and never which schema', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const health = await send(gateway.url, { path: '/healthz' });
  t.same([health.status, health.body], [200, { status: 'ok' }]);
  const latest = (await listMigrations()).at(-1)!.id;
  const ready = await send(gateway.url, { path: '/readyz' });
  t.same([ready.status, ready.body], [200, { status: 'ready' }], 'no schema version');

  await gateway.pool.query('delete from gateway.migrations where id = $1', [latest]);
  const behind = await send(gateway.url, { path: '/readyz' });
  t.equal(behind.status, 503);
  t.equal(behind.body.error.code, 'service_unavailable');
  t.ok(behind.headers.get('retry-after'));
  t.notMatch(behind.text, /migrat|schema|\d{2}/i, 'nor which migration is missing');
  t.ok(
    gateway.logs.some((line) => line.includes('"applied":' + (latest - 1)) && line.includes(`"expected":${latest}`)),
    'the log says',
  );
});

t.test('unknown routes are 404 route_not_found; wrong methods 405 method_not_allowed', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  for (const path of ['/', '/v1', '/v2/chat/completions', '/v1/chat/completions/extra', '/v1/requests']) {
    const answer = await send(gateway.url, { path, key });
    t.equal(answer.status, 404, `${path}: 404`);
    t.same(answer.body.error, { message: answer.body.error.message, type: 'not_found_error', code: 'route_not_found', param: null });
  }
  for (const [method, path] of [
    ['GET', '/v1/chat/completions'],
    ['PUT', '/v1/chat/completions'],
    ['DELETE', '/v1/requests/req_00000000000000000000'],
    ['PATCH', '/healthz'],
  ]) {
    const answer = await send(gateway.url, { method: method!, path: path!, key });
    t.equal(answer.status, 405, `${method} ${path}: 405`);
    t.equal(answer.body.error.code, 'method_not_allowed');
    t.equal(answer.body.error.type, 'invalid_request_error');
  }
});

t.test('an internal failure is a 500 internal_error that reveals nothing, and is logged', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  await gateway.pool.query('alter table gateway.requests rename column model to model_renamed');
  const answer = await client.post({ model: 'm', messages: userMessage() });
  t.equal(answer.status, 500);
  t.same(answer.body, {
    error: { message: 'The server failed to handle the request.', type: 'api_error', code: 'internal_error', param: null },
  });
  t.notMatch(answer.text, /column|select|insert|gateway\.|at .*\.ts/i, 'no SQL, no stack');
  t.ok(gateway.logs.some((line) => line.includes('"unhandled error"') && line.includes('model')), 'the cause is in the log');
});
