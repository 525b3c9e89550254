// The database out of connections for the gateway (53300, too many connections for its role):
// the API answers 503 service_unavailable with retry-after, never a 500, and logs no unhandled
// error. The gateway runs as a role limited to 3 connections, with a pool of 10.
import { randomBytes } from 'node:crypto';
import t from 'tap';
import { createDb, createPool } from '../../src/db/pool.ts';
import { createKey } from '../../src/keys/service.ts';
import { createLogger } from '../../src/logger.ts';
import { adminQuery, createTestDatabase } from '../helpers/database.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';

const CONNECTION_LIMIT = 3;

t.test(`a role limited to ${CONNECTION_LIMIT} connections, a pool of 10, many requests at once: every answer a 202 or a 503 with retry-after, never a 500`, async (t) => {
  const url = await createTestDatabase(t);
  const role = `gateway_limited_${randomBytes(4).toString('hex')}`;
  // A password too, for a server that asks for one (the embedded Postgres does; trust ignores it).
  const password = randomBytes(12).toString('hex');
  await adminQuery(url, async (admin) => {
    // (graphile-worker's tables have row-level security, which their owner bypasses: so must this role.)
    await admin.query(`create role ${role} login password '${password}' bypassrls connection limit ${CONNECTION_LIMIT}`);
    await admin.query(`grant usage on schema gateway, graphile_worker to ${role}`);
    await admin.query(`grant select, insert, update, delete on all tables in schema gateway, graphile_worker to ${role}`);
    await admin.query(`grant usage, select on all sequences in schema gateway, graphile_worker to ${role}`);
    await admin.query(`grant execute on all functions in schema gateway, graphile_worker to ${role}`);
  });
  // (Teardowns run last first: this one after the gateway stopped, before the database is dropped.)
  t.teardown(() =>
    adminQuery(url, async (admin) => {
      await admin.query(`select pg_terminate_backend(pid) from pg_stat_activity where usename = '${role}'`);
      await admin.query(`drop owned by ${role}`);
      await admin.query(`drop role ${role}`);
    }),
  );
  const limitedUrl = new URL(url);
  limitedUrl.username = role;
  limitedUrl.password = password;

  const gateway = await startTestGateway(t, {
    databaseUrl: limitedUrl.toString(),
    role: 'api',
    env: { DATABASE_POOL_SIZE: '10' },
  });
  // Keys made as the superuser, so that every connection of the role is the gateway's.
  const adminPool = createPool(url, { max: 2, applicationName: 'gateway-test', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => adminPool.end());
  const adminDb = createDb(adminPool);
  const keys = await Promise.all(
    Array.from({ length: 30 }, (_, i) => createKey(adminDb, gateway.config.secretEncryptionKeys[0], { project: `limited-${i}`, mode: 'test' })),
  );

  const answers = await Promise.all(
    keys.flatMap((key) => Array.from({ length: 10 }, (_, i) => clientFor(gateway.url, key).post({ model: 'test-echo', messages: userMessage(`m${i}`) }))),
  );
  const tally = new Map<number, number>();
  for (const answer of answers) tally.set(answer.status, (tally.get(answer.status) ?? 0) + 1);
  t.comment(`answers: ${JSON.stringify(Object.fromEntries(tally))}`);

  t.same(answers.filter((answer) => answer.status !== 202 && answer.status !== 503).map((answer) => [answer.status, answer.body]).slice(0, 5), [], 'every answer a 202 or a 503');
  const unavailable = answers.filter((answer) => answer.status === 503);
  t.ok(unavailable.length > 0, `the connection limit was reached: ${unavailable.length} answers were 503`);
  t.ok(answers.some((answer) => answer.status === 202), 'and the connections there were served requests');
  t.same(
    unavailable.filter((answer) => answer.body?.error?.code !== 'service_unavailable' || answer.body?.error?.type !== 'api_error' || !answer.headers.get('retry-after')).slice(0, 5).map((answer) => answer.body),
    [],
    'every 503 is service_unavailable, with retry-after',
  );
  t.notOk(gateway.logs.some((line) => line.includes('unhandled error')), 'no unhandled error logged');
  t.ok(gateway.logs.some((line) => line.includes('"code":"53300"')), 'the cause logged: 53300, too many connections');
});
