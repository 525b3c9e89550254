// Which database failures mean "unavailable" (a 503 with retry-after, and a retry for the
// worker): the server's by SQLSTATE alone, Node's socket errors by code, and pg's own failures
// to get or keep a connection by where they happened, never by their message.
import * as net from 'node:net';
import { sql } from 'kysely';
import pg from 'pg';
import t, { type Test } from 'tap';
import { createDb, createPool, isDatabaseUnavailable, isUnavailableState, type PoolOptions } from '../../src/db/pool.ts';
import { createLogger } from '../../src/logger.ts';
import { adminQuery, createTestDatabase, testDatabasePool, urlForDatabase } from '../helpers/database.ts';
import { freePort } from '../helpers/ports.ts';
import { startTcpProxy } from '../helpers/tcp-proxy.ts';
import { until } from '../helpers/wait.ts';

const logger = createLogger({ logLevel: 'silent' });

function serverError(code: string, message = 'from the server'): pg.DatabaseError {
  const error = new pg.DatabaseError(message, 0, 'error');
  error.code = code;
  return error;
}

t.test('server errors are judged by SQLSTATE: classes 08 and 53, 57014 and 57P01-57P05 are unavailable', async (t) => {
  const unavailable = {
    '08000': 'connection_exception',
    '08003': 'connection_does_not_exist',
    '08006': 'connection_failure',
    '08001': 'sqlclient_unable_to_establish_sqlconnection',
    '08P01': 'protocol_violation',
    '53000': 'insufficient_resources',
    '53100': 'disk_full',
    '53200': 'out_of_memory',
    '53300': 'too_many_connections',
    '53400': 'configuration_limit_exceeded',
    '57014': 'query_canceled (statement timeout)',
    '57P01': 'admin_shutdown',
    '57P02': 'crash_shutdown',
    '57P03': 'cannot_connect_now',
    '57P04': 'database_dropped',
    '57P05': 'idle_session_timeout',
  };
  for (const [code, name] of Object.entries(unavailable)) {
    t.ok(isUnavailableState(code), `${code} ${name}`);
    t.ok(isDatabaseUnavailable(serverError(code)), `${code} ${name}, as a DatabaseError`);
  }
  const available = {
    '23505': 'unique_violation',
    '42601': 'syntax_error',
    '42P01': 'undefined_table',
    '22P02': 'invalid_text_representation',
    '40001': 'serialization_failure',
    '40P01': 'deadlock_detected',
    '28P01': 'invalid_password',
    '3D000': 'invalid_catalog_name',
    '57000': 'operator_intervention',
    '57P06': 'not a code',
    '55P03': 'lock_not_available',
    '25P03': 'idle_in_transaction_session_timeout',
  };
  for (const [code, name] of Object.entries(available)) {
    t.notOk(isDatabaseUnavailable(serverError(code)), `not ${code} ${name}`);
  }
  t.notOk(isDatabaseUnavailable(serverError('42601', 'timeout exceeded when trying to connect')), 'a server error is judged by its code, not its message');
});

t.test("Node's socket errors are unavailable, by their code or their cause's", async (t) => {
  for (const code of ['ECONNREFUSED', 'ECONNRESET', 'ENOTFOUND', 'EAI_AGAIN', 'ETIMEDOUT', 'EPIPE', 'EHOSTUNREACH', 'ENETUNREACH']) {
    const error = Object.assign(new Error(`connect ${code}`), { code });
    t.ok(isDatabaseUnavailable(error), code);
    t.ok(isDatabaseUnavailable(new Error('wrapped', { cause: error })), `${code} as a cause`);
  }
  t.notOk(isDatabaseUnavailable(Object.assign(new Error('no such file'), { code: 'ENOENT' })), 'not ENOENT');
});

t.test("pg's messages alone mean nothing: an error not raised while getting or using a connection is not unavailable", async (t) => {
  for (const message of [
    'timeout exceeded when trying to connect',
    'Connection terminated unexpectedly',
    'Connection terminated due to connection timeout',
    'Client has encountered a connection error and is not queryable',
  ]) {
    t.notOk(isDatabaseUnavailable(new Error(message)), message);
  }
  t.notOk(isDatabaseUnavailable(new TypeError('x is not a function')));
  t.notOk(isDatabaseUnavailable('ECONNREFUSED'));
  t.notOk(isDatabaseUnavailable(undefined));
});

t.test('against a real server: what each failure is', async (t) => {
  const { url, pool, db } = await testDatabasePool(t, 'unavailable-test');
  const failure = (run: () => Promise<unknown>) => run().then(() => undefined, (error: unknown) => error);

  const syntax = await failure(() => sql`selec 1`.execute(db));
  t.match(syntax, { code: '42601' });
  t.notOk(isDatabaseUnavailable(syntax), 'a syntax error is not');

  const timedOut = await failure(() => db.connection().execute(async (connection) => {
    await sql`set statement_timeout = 50`.execute(connection);
    try {
      await sql`select pg_sleep(2)`.execute(connection);
    } finally {
      await sql`reset statement_timeout`.execute(connection);
    }
  }));
  t.match(timedOut, { code: '57014' });
  t.ok(isDatabaseUnavailable(timedOut), 'a statement timeout (57014) is unavailable');

  const terminated = failure(() => sql`select pg_sleep(10)`.execute(db));
  await adminQuery(url, (admin) =>
    until(async () => {
      const { rowCount } = await admin.query(
        `select pg_terminate_backend(pid) from pg_stat_activity where query = 'select pg_sleep(10)' and pid <> pg_backend_pid()`,
      );
      return (rowCount ?? 0) > 0;
    }, 'the sleeping statement to be terminated'),
  );
  const shutdown = await terminated;
  t.match(shutdown, { code: '57P01' });
  t.ok(isDatabaseUnavailable(shutdown), 'a terminated backend (57P01 admin_shutdown) is unavailable');

  const missing = createPool(urlForDatabase(url, 'gateway_no_such_database'), { max: 1, applicationName: 'unavailable-test', logger });
  t.teardown(() => missing.end());
  const noDatabase = await failure(() => sql`select 1`.execute(createDb(missing)));
  t.match(noDatabase, { code: '3D000' });
  t.notOk(isDatabaseUnavailable(noDatabase), 'the server refusing a connection for a reason of its own (3D000) is not');

  const refused = createPool(`postgres://postgres@127.0.0.1:${await freePort()}/postgres`, { max: 1, applicationName: 'unavailable-test', logger });
  t.teardown(() => refused.end());
  const noServer = await failure(() => sql`select 1`.execute(createDb(refused)));
  t.match(noServer, { code: 'ECONNREFUSED' });
  t.ok(isDatabaseUnavailable(noServer), 'no server listening (ECONNREFUSED) is unavailable');
});

t.test("pg's own failures to get or keep a connection are unavailable, though they carry nothing but a message", async (t) => {
  const { url, proxy, pool, db } = await proxiedPool(t, { max: 1, applicationName: 'unavailable-test', logger });
  const failure = (run: () => Promise<unknown>) => run().then(() => undefined, (error: unknown) => error);

  // The connection is dropped under a statement, without a word from the server.
  const running = failure(() => sql`select pg_sleep(10)`.execute(db));
  await adminQuery(url, (admin) =>
    until(async () => {
      const { rowCount } = await admin.query(
        `select from pg_stat_activity where application_name = 'unavailable-test' and query = 'select pg_sleep(10)' and state = 'active'`,
      );
      return (rowCount ?? 0) > 0;
    }, 'the statement to be running'),
  );
  proxy.cut();
  const dropped = await running;
  t.match(dropped, { message: /Connection terminated unexpectedly/ });
  t.ok(isDatabaseUnavailable(dropped), 'a connection lost under a statement');

  // No connection can be had.
  const refused = await failure(() => sql`select 1`.execute(db));
  t.type(refused, Error);
  t.notOk(refused instanceof pg.DatabaseError, `pg's own error: ${(refused as Error).message}`);
  t.ok(isDatabaseUnavailable(refused), 'a connection closed as it opens');
  proxy.restore();

  // Every pooled connection is taken, for longer than the pool waits for one (5 s).
  const held = await pool.connect();
  const waited = await failure(() => sql`select 1`.execute(db));
  held.release();
  t.match(waited, { message: 'timeout exceeded when trying to connect' });
  t.ok(isDatabaseUnavailable(waited), 'no pooled connection free in time');
  t.same((await sql<{ one: number }>`select 1 as one`.execute(db)).rows, [{ one: 1 }], 'and the pool serves again');
});

t.test('a connection that no waiting would make is not unavailable: TLS the server does not have, SCRAM without a password, a TLS handshake failing', async (t) => {
  const failure = async (url: string) => {
    const pool = createPool(url, { max: 1, applicationName: 'unavailable-test', logger });
    t.teardown(() => pool.end());
    return sql`select 1`.execute(createDb(pool)).then(() => undefined, (error: unknown) => error);
  };

  const url = new URL(await createTestDatabase(t));
  url.searchParams.set('sslmode', 'require');
  const noTls = await failure(url.toString());
  t.match(noTls, { message: 'The server does not support SSL connections' });
  t.notOk(isDatabaseUnavailable(noTls), 'TLS asked of a server without it');

  // A server asking for SCRAM-SHA-256, then sending its first message.
  const scram = await fakeServer(t, (socket, received) => {
    if (received === 1) socket.write(authentication(10, Buffer.from('SCRAM-SHA-256\0\0')));
    else socket.write(authentication(11, Buffer.from('r=nonce,s=c2FsdA==,i=4096')));
  });
  const noPassword = await failure(`postgres://postgres@127.0.0.1:${scram}/postgres`);
  t.match(noPassword, { message: /^SASL: .*client password must be a string/ });
  t.notOk(isDatabaseUnavailable(noPassword), 'SCRAM without a password');

  // A server accepting TLS (S), then answering the handshake with what is no TLS.
  const notTls = await fakeServer(t, (socket, received) => {
    if (received === 1) socket.write('S');
    else socket.write(Buffer.alloc(64, 'x'));
  });
  const handshake = await failure(`postgres://postgres@127.0.0.1:${notTls}/postgres?sslmode=no-verify`);
  t.match(handshake, { code: 'EPROTO', message: /wrong version number/ });
  t.notOk(isDatabaseUnavailable(handshake), `a TLS handshake failing (${(handshake as { code: string }).code})`);
});

t.test('a connection Postgres ends as it answers its session settings is not handed out: the statement runs on another', async (t) => {
  const logs: Record<string, unknown>[] = [];
  const { proxy, db } = await proxiedPool(t, { max: 2, applicationName: 'unavailable-hand-out', logger: createLogger({ logLevel: 'warn' }, lineSink(logs)) });

  // The answer to the settings of the pool's first connection (its SETs), and in the same read
  // the FATAL that pg_terminate_backend has Postgres send, then the end of the connection.
  let ended = 0;
  proxy.afterNextReply(
    'unavailable-hand-out',
    (client) => {
      client.end(fatal('57P01', 'terminating connection due to administrator command'));
      ended++;
    },
    (reply) => reply.includes('SET\0'),
  );
  const { rows } = await sql<{ one: number }>`select 1 as one`.execute(db);
  t.equal(ended, 1, 'the first connection was ended as it answered its settings');
  t.same(rows, [{ one: 1 }], 'the statement ran, on another connection');
  t.ok(logs.some((entry) => entry.msg === 'database connection lost'), 'the lost connection was logged');
  t.same((await sql<{ one: number }>`select 1 as one`.execute(db)).rows, [{ one: 1 }], 'and the pool serves on');
});

t.test('a pool whose every new connection is ended as it is handed out fails its statement as unavailable', async (t) => {
  const { proxy, db } = await proxiedPool(t, { max: 2, applicationName: 'unavailable-hand-outs', logger });
  const endNext = () =>
    proxy.afterNextReply(
      'unavailable-hand-outs',
      (client) => {
        client.end(fatal('57P01', 'terminating connection due to administrator command'));
        endNext();
      },
      (reply) => reply.includes('SET\0'),
    );
  endNext();
  const failed = await sql`select 1`.execute(db).then(() => undefined, (error: unknown) => error);
  t.type(failed, Error);
  t.ok(isDatabaseUnavailable(failed), `unavailable: ${(failed as Error).message}`);
});

/** A pool made as the gateway's are, on a test database of its own, reached through a TCP proxy. */
async function proxiedPool(t: Test, options: PoolOptions) {
  const url = await createTestDatabase(t);
  const proxy = await startTcpProxy(t, url);
  const pool = createPool(proxy.url, options);
  t.teardown(() => pool.end());
  return { url, proxy, pool, db: createDb(pool) };
}

/** A server on a free port of loopback that calls `answer` with each packet a client sends (1 the first). */
async function fakeServer(t: Test, answer: (socket: net.Socket, received: number) => void): Promise<number> {
  const sockets = new Set<net.Socket>();
  const server = net.createServer((socket) => {
    sockets.add(socket);
    let received = 0;
    socket.on('data', () => answer(socket, ++received));
    socket.on('error', () => {});
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  t.teardown(() => {
    for (const socket of sockets) socket.destroy();
    return new Promise<void>((resolve) => server.close(() => resolve()));
  });
  return (server.address() as net.AddressInfo).port;
}

/** A backend's Authentication message: its kind (10 SASL, 11 SASL continue) and what follows. */
function authentication(kind: number, data: Buffer): Buffer {
  const head = Buffer.alloc(9);
  head.write('R', 0);
  head.writeInt32BE(8 + data.length, 1);
  head.writeInt32BE(kind, 5);
  return Buffer.concat([head, data]);
}

/** A backend's ErrorResponse: severity FATAL, its SQLSTATE and message. */
function fatal(code: string, message: string): Buffer {
  const fields = Buffer.from(`SFATAL\0VFATAL\0C${code}\0M${message}\0\0`);
  const head = Buffer.alloc(5);
  head.write('E', 0);
  head.writeInt32BE(4 + fields.length, 1);
  return Buffer.concat([head, fields]);
}

/** A log destination keeping each line's entry. */
function lineSink(entries: Record<string, unknown>[]): { write(line: string): void } {
  return { write: (line) => void entries.push(JSON.parse(line) as Record<string, unknown>) };
}
