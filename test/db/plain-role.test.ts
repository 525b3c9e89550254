// The gateway needs no superuser (docs/operations.md): a role with LOGIN and no other attribute
// (no SUPERUSER, CREATEDB, CREATEROLE or BYPASSRLS) migrates a database, serves the API, runs the
// worker with its periodic tasks and runs the administrative commands, on a database it owns and
// on one where it may only create schemas (with CONNECT and TEMP, as every role has them).
import { randomBytes } from 'node:crypto';
import t from 'tap';
import { createLogger } from '../../src/logger.ts';
import { Metrics } from '../../src/metrics.ts';
import type { CreatedKey } from '../../src/keys/service.ts';
import { cleanupNoncesTask } from '../../src/worker/cleanup-nonces.ts';
import { expireOverdue } from '../../src/worker/deadlines.ts';
import { pruneQueues } from '../../src/worker/prune.ts';
import { rescueStranded } from '../../src/worker/rescue.ts';
import { retentionTask } from '../../src/worker/retention.ts';
import { cliOutput } from '../helpers/cli.ts';
import { adminQuery, urlForDatabase } from '../helpers/database.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { until } from '../helpers/wait.ts';
import { startReceiver } from '../webhooks/support.ts';

const silent = createLogger({ logLevel: 'silent' });
/** What Postgres says of a statement a role may not run. */
const REFUSED = /42501|permission denied|must be (owner|superuser)/;

for (const database of ['it owns', 'where it may only create schemas'] as const) {
  t.test(`a role with LOGIN alone, on a database ${database}: migrate, serve (all), keys, webhooks, requests, periodic tasks`, async (t) => {
    const adminUrl = process.env.GATEWAY_TEST_ADMIN_URL!;
    const suffix = randomBytes(4).toString('hex');
    const role = `gateway_plain_${suffix}`;
    const name = `gateway_test_plain_${suffix}`;
    // A password too, for a server that asks for one (the embedded Postgres does; trust ignores it).
    const password = randomBytes(12).toString('hex');
    await adminQuery(adminUrl, async (admin) => {
      await admin.query(`create role ${role} login password '${password}' nosuperuser nocreatedb nocreaterole nobypassrls`);
      if (database === 'it owns') {
        await admin.query(`create database ${name} owner ${role}`);
      } else {
        await admin.query(`create database ${name}`);
        await admin.query(`grant create on database ${name} to ${role}`);
      }
    });
    // (Teardowns run last first: the database is dropped, with the role's connections, before the role.)
    t.teardown(() => adminQuery(adminUrl, (admin) => admin.query(`drop role if exists ${role}`).then(() => {})));
    t.teardown(() => adminQuery(adminUrl, (admin) => admin.query(`drop database if exists ${name} with (force)`).then(() => {})));
    const url = new URL(urlForDatabase(adminUrl, name));
    url.username = role;
    url.password = password;
    const databaseUrl = url.toString();

    const attributes = await adminQuery(databaseUrl, (client) =>
      client.query('select rolsuper, rolcreatedb, rolcreaterole, rolbypassrls from pg_roles where rolname = current_user'),
    );
    t.same(attributes.rows, [{ rolsuper: false, rolcreatedb: false, rolcreaterole: false, rolbypassrls: false }], 'the gateway connects as a role with none of those attributes');

    t.equal(await cliOutput(['migrate'], { DATABASE_URL: databaseUrl }), 'The database schema is up to date.\n', 'gateway migrate, as the role');
    const gateway = await startTestGateway(t, {
      databaseUrl,
      role: 'all',
      // Sweeps and chores often (their failures are logged at debug level), webhook retries quick,
      // a call long enough to be cancelled.
      env: { LOG_LEVEL: 'debug', UPSTREAM_TIMEOUT_MS: '60000', WORKER_DEAD_AFTER_MS: '1000', PRUNE_IDLE_QUEUES_AFTER: '1s', WEBHOOK_ALLOW_PRIVATE: 'true', WEBHOOK_RETRY_SCHEDULE: '100,200,400' },
    });
    const env = {
      DATABASE_URL: databaseUrl,
      SECRET_ENCRYPTION_KEY: gateway.config.secretEncryptionKeys[0]!.toString('base64'),
      WEBHOOK_ALLOW_PRIVATE: 'true',
    };
    const key = JSON.parse(await cliOutput(['keys', 'create', '--project', 'plain', '--mode', 'test', '--json'], env)) as CreatedKey;
    const receiver = await startReceiver(t);
    const endpoint = JSON.parse(await cliOutput(['webhooks', 'add', '--project', 'plain', '--url', receiver.url, '--json'], env)) as { id: string; secret: string };
    receiver.secrets = [endpoint.secret];

    const client = clientFor(gateway.url, key);
    const waited = await client.post({ model: 'test-echo', messages: userMessage('as a plain role'), wait: true });
    t.equal(waited.status, 200, 'wait=true: 200');
    t.equal(waited.body.choices?.[0]?.message?.content, 'as a plain role', 'with the completion');
    const retried = { model: 'test-fail-1', messages: userMessage('retried'), wait: true, idempotency_key: 'plain-1' };
    t.equal((await client.post(retried)).status, 200, 'a request that fails once completes on its retry');
    const replayed = await client.post(retried);
    t.equal(replayed.headers.get('idempotent-replayed'), 'true', 'its idempotent replay');
    const failed = await client.post({ model: 'test-error-400', messages: userMessage('fails'), wait: true });
    t.equal(failed.body.status, 'failed', 'a request that fails');
    const slow = await client.post({ model: 'test-delay-30000', messages: userMessage('cancelled') });
    t.equal(slow.status, 202);
    const looked = await client.get(slow.body.id);
    t.equal(looked.status, 200, 'looked up');
    const cancelled = await send(gateway.url, { method: 'POST', path: `/v1/requests/${slow.body.id}/cancel`, key });
    t.same([cancelled.status, cancelled.body.status], [200, 'cancelled'], 'cancelled');

    await until(() => receiver.deliveries.filter((delivery) => delivery.verifiedWith.length > 0).length >= 4, 'the four events delivered', 30_000);
    t.same(
      receiver.deliveries.map((delivery) => delivery.event?.type).sort(),
      ['request.cancelled', 'request.completed', 'request.completed', 'request.failed'],
      'each event delivered, signed',
    );

    // The cron tasks and the chores, as the worker runs them, on the role's connections.
    const deps = { db: gateway.db, logger: silent, metrics: new Metrics() };
    await retentionTask({ ...deps, config: { retentionDays: 1, bodyRetentionHours: 1 } })({}, {} as never);
    await cleanupNoncesTask(deps)({}, {} as never);
    await pruneQueues(deps, 1_000);
    await expireOverdue(deps);
    await rescueStranded(deps, 1_000);
    t.pass('retention, nonce clean-up, pruning, deadlines and rescue ran');

    for (const args of [['keys', 'list'], ['webhooks', 'list'], ['requests', 'list'], ['requests', 'show', slow.body.id], ['stats'], ['upstreams'], ['usage'], ['keys', 'reencrypt'], ['webhooks', 'rotate-secret', endpoint.id], ['webhooks', 'remove', endpoint.id], ['keys', 'revoke', key.id]]) {
      await cliOutput(args, env);
    }
    t.pass('every administrative command ran');
    await until(async () => (await client.get(slow.body.id)).status === 401, 'the revoked key refused', 10_000);

    // Each sweep and chore of the worker has run several times by now (every 100 to 500 ms).
    await gateway.stop();
    t.same(gateway.logs.filter((line) => REFUSED.test(line)), [], 'nothing was refused to the role');
  });
}
