// Connection pools and the kysely instance. Pools are bounded and short-lived connections are
// the rule: no connection is held while an upstream call is under way.
import { Kysely, PostgresDialect } from 'kysely';
import pg from 'pg';
import type { Logger } from '../logger.ts';
import type { Database } from './database.ts';

export const SCHEMA = 'gateway';

export type Db = Kysely<Database>;

export interface PoolOptions {
  max: number;
  /** Shown in pg_stat_activity.application_name, so operators can tell the roles apart. */
  applicationName: string;
  logger: Logger;
}

export function createPool(connectionString: string, options: PoolOptions): pg.Pool {
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
  });
  // A client losing its connection emits 'error', which would crash the process with nobody
  // listening: idle clients on the pool, checked-out ones on the client (whose query then
  // fails, and is handled where it was made). The pool replaces lost clients by itself.
  pool.on('error', (error) => {
    options.logger.warn({ err: errorSummary(error), pool: options.applicationName }, 'idle database connection lost');
  });
  pool.on('connect', (client) => {
    client.on('error', (error) => {
      options.logger.warn({ err: errorSummary(error), pool: options.applicationName }, 'database connection lost');
    });
  });
  return pool;
}

export function createDb(pool: pg.Pool): Db {
  return new Kysely<Database>({ dialect: new PostgresDialect({ pool }) }).withSchema(SCHEMA);
}

/** Connection-level failures: the database is down, restarting or out of reach. */
export function isDatabaseUnavailable(error: unknown): boolean {
  if (!(error instanceof Error)) return false;
  const code = (error as { code?: unknown }).code;
  if (typeof code === 'string') {
    // Node socket errors, and Postgres classes 08 (connection exception) and 57P (operator
    // intervention: shutdown, crash recovery, cannot connect now).
    if (/^(ECONNREFUSED|ECONNRESET|ENOTFOUND|EAI_AGAIN|ETIMEDOUT|EPIPE|EHOSTUNREACH|ENETUNREACH)$/.test(code)) {
      return true;
    }
    if (code.startsWith('08') || code.startsWith('57P')) return true;
  }
  return /timeout exceeded when trying to connect|Connection terminated|connection timeout|Client has encountered a connection error/i.test(
    error.message,
  );
}

/** What of a database error may be logged: its class, code and message, not its query or values. */
export function errorSummary(error: unknown): { name: string; code?: string; message: string } {
  if (!(error instanceof Error)) return { name: 'Error', message: String(error) };
  const code = (error as { code?: unknown }).code;
  return { name: error.name, ...(typeof code === 'string' ? { code } : {}), message: error.message };
}
