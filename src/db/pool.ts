// Connection pools and the kysely instance. Pools are bounded and short-lived connections are
// the rule: no connection is held while an upstream call is under way.
import { Kysely, PostgresDialect, type PostgresPool, type PostgresPoolClient } from 'kysely';
import pg from 'pg';
import type { Logger } from '../logger.ts';
import { errorCode, findCause, isTlsFailure, isUnreachable } from '../network-errors.ts';
import type { Database } from './database.ts';

export const SCHEMA = 'gateway';

export type Db = Kysely<Database>;

export interface PoolOptions {
  max: number;
  /** Shown in pg_stat_activity.application_name, so operators can tell the roles apart. */
  applicationName: string;
  logger: Logger;
  /**
   * Plans each named statement once per connection, and compiles none (SESSION_SETTINGS), as the
   * service's pools do; false for a command's pool, whose statements run once each and are best
   * planned for their values.
   */
  sessionSettings?: boolean;
}

/**
 * The session settings of a pool with generic plans.
 *
 * plan_cache_mode. Left to itself, Postgres plans a prepared statement afresh for the values of
 * each of its first five runs on a connection, and then for every run whose values it judges
 * would make a cheaper plan than the generic one. A statement that takes a group of rows as
 * arrays (`unnest($1::text[], ...)`) is always judged so: the generic plan counts a hundred rows
 * in each array, the fresh one the few it holds. Without this setting, the grouped statements on
 * every request's path are planned at nearly every run, and planning the full finish of a group
 * of attempts takes 2 to 6 ms, more than running it. Their generic plans join a group to the
 * tables' indexes as the fresh ones do, and a connection makes them again every REPLAN_EVERY
 * statements, with the tables as they are then (see below).
 *
 * jit. Postgres compiles a statement to machine code when its plan's estimated cost is high, and
 * a generic plan's can be: it counts a default share of a queue's rows as due, where a fresh plan
 * sees the times. With 20,000 requests queued, a generic plan of the claim's choice of requests
 * (gateway.claim_queue) is compiled at every run, 10 to 12 ms each, to run in 0.1 to 0.3 ms. No
 * statement of the service runs long enough for compiling to pay.
 */
const SESSION_SETTINGS = { plan_cache_mode: 'force_generic_plan', jit: 'off' } as const;
const SET_SESSION = Object.entries(SESSION_SETTINGS)
  .map(([name, value]) => `set ${name} = ${value}`)
  .join('; ');

export function createPool(connectionString: string, options: PoolOptions): pg.Pool {
  // A client losing its connection emits 'error', which would crash the process with nobody
  // listening: idle clients on the pool, checked-out ones on the client (whose query then
  // fails, and is handled where it was made). The pool replaces lost clients by itself.
  const watch = (client: pg.ClientBase) => {
    if (watched.has(client)) return;
    watched.add(client);
    client.on('error', (error) => {
      // Emitted before pg fails the statements under way on this client, so their failures are
      // known for a lost connection's (isDatabaseUnavailable).
      lostClients.add(client);
      options.logger.warn({ err: errorSummary(error), pool: options.applicationName }, 'database connection lost');
    });
  };
  const pool = new pg.Pool({
    connectionString,
    max: options.max,
    application_name: options.applicationName,
    // Fail fast when the database is unreachable, so callers get a 503 rather than a hang.
    connectionTimeoutMillis: 5_000,
    idleTimeoutMillis: 30_000,
    // Shared database etiquette: no statement or idle transaction may hold locks for long.
    statement_timeout: 30_000,
    idle_in_transaction_session_timeout: 60_000,
    keepAlive: true,
    // On each new connection, before any statement of the caller it is handed to. Watched from
    // here on: the pool announces the connection ('connect') only once these have run, and a
    // connection lost meanwhile would be handed out unknown (see usableClient).
    ...((options.sessionSettings ?? true) && {
      onConnect: async (client: pg.ClientBase) => {
        watch(client);
        await client.query(SET_SESSION);
      },
    }),
  });
  pool.on('error', (error) => {
    options.logger.warn({ err: errorSummary(error), pool: options.applicationName }, 'idle database connection lost');
  });
  pool.on('connect', watch);
  return pool;
}

export function createDb(pool: pg.Pool): Db {
  return new Kysely<Database>({ dialect: new PostgresDialect({ pool: preparing(pool) }) }).withSchema(SCHEMA);
}

// Every distinct statement text gets a name, so each connection parses and plans it once and
// then only binds and executes it: the hot statements (the grouped insert, the lookup, the
// worker's claim and finish) are the same few texts over and over. The names are bounded in
// case some statement ever carried its values in its text.
const MAX_PREPARED = 500;
const statementNames = new Map<string, string>();

/**
 * Named statements a connection runs between two `DISCARD PLANS`.
 *
 * A prepared statement's generic plan (the only one, with SESSION_SETTINGS; else the one most
 * settle on after their first runs) is made with the tables as they were then, and Postgres keeps
 * it until the tables are next analyzed: by autovacuum, or never where it is off. Made while they
 * were nearly empty (a new database, the first seconds after start), that plan joins a group of
 * rows to a sequential scan of each table, however much the tables grow (thousands of rows read to
 * update two). Dropping a connection's plans now and then has them made again with the tables as
 * they are: once the tables have grown, the new plans use the indexes, and keep doing so. It costs
 * a round trip and a few plannings per REPLAN_EVERY statements, where planning every statement
 * would cost more than running most of them. (graphile-worker's add_jobs, which plans its
 * statements itself, is kept on its indexes by settings on the function instead: db/migrate.ts.)
 */
export const REPLAN_EVERY = 256;
const statementsRun = new WeakMap<pg.PoolClient, number>();

function statementName(text: string): string | undefined {
  let name = statementNames.get(text);
  if (name === undefined && statementNames.size < MAX_PREPARED) {
    name = `gateway_${statementNames.size}`;
    statementNames.set(text, name);
  }
  return name;
}

/** Counts a named statement about to run on `client`; true every REPLAN_EVERY: drop its plans first. */
function replanDue(client: pg.PoolClient): boolean {
  const run = (statementsRun.get(client) ?? 0) + 1;
  statementsRun.set(client, run);
  return run % REPLAN_EVERY === 0;
}

/** The pool as kysely sees it, preparing what it runs. */
function preparing(pool: pg.Pool): PostgresPool {
  return {
    options: pool.options,
    end: () => pool.end(),
    async connect(): Promise<PostgresPoolClient> {
      const client = await usableClient(pool);
      const run = (query: pg.QueryConfig) => queryOn<pg.QueryResultRow>(client, query);
      return {
        query: (async (text: string, values: readonly unknown[]) => {
          const name = statementName(text);
          if (name === undefined) return run({ text, values: [...values] });
          // (Allowed inside a transaction. Should it fail, the connection is lost, and the
          // statement fails with it.)
          if (replanDue(client)) await run({ text: 'discard plans' });
          return run({ name, text, values: [...values] });
        }) as unknown as PostgresPoolClient['query'],
        release: (destroy?: boolean) => client.release(destroy),
      };
    },
  };
}

/** Lost connections one caller is handed at most before its statement fails as the database's unavailability. */
const HAND_OUT_TRIES = 3;

/**
 * A pooled connection that has not been lost. pg-pool hands out a new connection even if it was
 * lost after its session settings ran: Postgres ending a backend as it answered them
 * (pg_terminate_backend, a restart), its FATAL read together with their answer. Its first
 * statement would fail with a message alone ("not queryable"); another connection is taken
 * instead, a few times before the failure is the database's unavailability.
 */
async function usableClient(pool: pg.Pool): Promise<pg.PoolClient> {
  for (let tries = 1; ; tries++) {
    let client: pg.PoolClient;
    try {
      client = await pool.connect();
    } catch (error) {
      // (A pool that is ending is no outage: nothing should be waiting to try again.)
      throw pool.ending || !isConnectionOutage(error) ? error : noConnection(error);
    }
    if (!lostClients.has(client)) return client;
    client.release(true);
    if (tries === HAND_OUT_TRIES) throw noConnection(new Error('database connection lost as it was handed out'));
  }
}

/**
 * One statement on a usable connection of the pool, its failure judged as a prepared statement's
 * is (isDatabaseUnavailable): for the few statements run on a pool rather than through kysely.
 */
export async function poolQuery<R extends pg.QueryResultRow>(pool: pg.Pool, text: string): Promise<pg.QueryResult<R>> {
  const client = await usableClient(pool);
  try {
    return await queryOn<R>(client, { text });
  } finally {
    client.release();
  }
}

/** A statement on the client; its failure, if the client has reported its connection lost, is the database's unavailability. */
function queryOn<R extends pg.QueryResultRow>(client: pg.PoolClient, query: pg.QueryConfig): Promise<pg.QueryResult<R>> {
  return client.query<R>(query).catch((error: unknown) => {
    throw lostClients.has(client) ? noConnection(error) : error;
  });
}

// What isDatabaseUnavailable knows of pg's own failures, which carry no SQLSTATE and are bare
// Errors told apart only by their messages ("timeout exceeded when trying to connect",
// "Connection terminated unexpectedly", "Client has encountered a connection error and is not
// queryable"...): they are known here by where they happened instead. A statement failing on a
// client that reported its connection lost (lostClients) is marked unavailable (noConnection),
// whatever pg's message; a connection that could not be had, only when it was lost, refused or
// timed out (isConnectionOutage).
const lostClients = new WeakSet<pg.ClientBase>();
/** Clients whose 'error' is listened for (createPool). */
const watched = new WeakSet<pg.ClientBase>();
const unavailableErrors = new WeakSet<object>();

/**
 * Marks a failure to keep a connection, or an outage's failure to get one (isConnectionOutage),
 * as the database being unavailable if it is one of pg's own (a bare Error): not the server's
 * answer (a DatabaseError, judged by its SQLSTATE: a wrong password is no outage) nor a
 * programming error (a TypeError, say).
 */
function noConnection(error: unknown): unknown {
  if (error instanceof Error && Object.getPrototypeOf(error) === Error.prototype) unavailableErrors.add(error);
  return error;
}

/**
 * pg's own failures to connect that say the connection was refused, lost or timed out, which a
 * database starting or restarting gives: the pool waiting for a free connection in vain, a
 * connection closed before it was made, or one not made in time. Anything else pg raises while
 * connecting is a setting the server will never take, whose failure should stop a start rather
 * than be waited out: a server without TLS asked for it ("The server does not support SSL
 * connections"), SCRAM without a password ("SASL: ... client password must be a string"), a
 * certificate refused.
 */
const OUTAGE_MESSAGES = /^(timeout exceeded when trying to connect$|Connection terminated\b)/;

/**
 * Whether a failure to get a connection is an outage: a socket's error (a Node system error, with
 * the call that failed: connect ECONNREFUSED, ENOENT for a Unix socket not made yet, ...) or one
 * of OUTAGE_MESSAGES; never a TLS handshake that failed, nor the socket's EPROTO for an answer to
 * it that was no TLS. (The server's answers, DatabaseErrors, are judged by their SQLSTATE.)
 */
function isConnectionOutage(error: unknown): boolean {
  if (!(error instanceof Error) || isTlsFailure(error) || errorCode(error) === 'EPROTO') return false;
  const systemError = (cause: unknown) => typeof (cause as { syscall?: unknown } | null | undefined)?.syscall === 'string';
  return OUTAGE_MESSAGES.test(error.message) || findCause(error, systemError) !== undefined;
}

/**
 * SQLSTATEs of a database that cannot serve now, though it may soon: class 08 (connection
 * exception), class 53 (insufficient resources: too many connections, out of memory, disk
 * full), 57014 (statement timeout, or cancelled) and 57P01-57P05 (admin shutdown, crash
 * shutdown, cannot connect now, database dropped, idle session timeout).
 */
export function isUnavailableState(sqlstate: string): boolean {
  return (
    sqlstate.startsWith('08') ||
    sqlstate.startsWith('53') ||
    sqlstate === '57014' ||
    /^57P0[1-5]$/.test(sqlstate)
  );
}

/**
 * The database is down, restarting, out of reach or out of resources: a failure that is no
 * fault of the statement's, answered 503 with retry-after and ridden out by retries. The
 * server's errors are judged by their SQLSTATE alone; errors without one by their socket error
 * code (their own or a cause's, as network-errors.ts knows them), or by having happened while
 * getting or using a connection (see noConnection).
 */
export function isDatabaseUnavailable(error: unknown): boolean {
  if (error instanceof pg.DatabaseError) return error.code !== undefined && isUnavailableState(error.code);
  if (!(error instanceof Error)) return false;
  return unavailableErrors.has(error) || isUnreachable(error);
}

/**
 * The statement's transaction lost a conflict with another one and was rolled back: chosen as a
 * deadlock's victim (40P01), or a serialization failure (40001). Nothing is wrong with the
 * statement nor with the database: run again, it mostly succeeds.
 */
export function isConflict(error: unknown): boolean {
  return error instanceof pg.DatabaseError && (error.code === '40001' || error.code === '40P01');
}

/** What of a database error may be logged: its class, code and message, not its query or values. */
export function errorSummary(error: unknown): { name: string; code?: string; message: string } {
  if (!(error instanceof Error)) return { name: 'Error', message: String(error) };
  const code = (error as { code?: unknown }).code;
  return { name: error.name, ...(typeof code === 'string' ? { code } : {}), message: error.message };
}
