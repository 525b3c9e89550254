// The Postgres server the benchmark runs on: DATABASE_URL's when it is set, otherwise an
// embedded cluster under .data/bench-postgres (durable, like a real one). Every phase gets a
// database of its own, cloned from a template that was migrated and given a test key once;
// all of them are dropped at the end.
import { readFileSync } from 'node:fs';
import path from 'node:path';
import pg from 'pg';
import { startEmbeddedPostgres } from '../src/db/embedded.ts';
import { createLogger } from '../src/logger.ts';
import { freePort } from '../scripts/ports.ts';

export const BENCH_APPLICATION_NAME = 'gateway-bench';

export interface Server {
  /** Connection string of the server's maintenance database (where databases are created). */
  adminUrl: string;
  /** The postmaster's pid, when the server runs on this machine (for CPU accounting). */
  postmasterPid: number | undefined;
  describe: ServerDescription;
  urlFor(database: string): string;
  createDatabase(name: string, template?: string): Promise<void>;
  dropDatabase(name: string): Promise<void>;
  stop(): Promise<void>;
}

export interface ServerDescription {
  version: string;
  settings: Record<string, string>;
  where: string;
}

export async function openServer(databaseUrl: string | undefined, dataDir: string): Promise<Server> {
  let adminUrl = databaseUrl;
  let stopCluster = async () => {};
  if (adminUrl === undefined) {
    const cluster = await startEmbeddedPostgres({
      directory: path.join(dataDir, 'bench-postgres'),
      port: await freePort(),
      logger: createLogger({ logLevel: 'warn' }, process.stderr),
      durable: true,
    });
    adminUrl = cluster.url;
    stopCluster = () => cluster.stop();
  }
  const admin = adminUrl;
  const urlFor = (database: string) => {
    const url = new URL(admin);
    url.pathname = `/${database}`;
    return url.toString();
  };
  const describe = await withClient(admin, async (client) => {
    const { rows } = await client.query<{ name: string; setting: string }>(
      `select name, current_setting(name) as setting from pg_settings
       where name in ('server_version', 'fsync', 'synchronous_commit', 'wal_sync_method', 'shared_buffers',
                      'max_connections', 'commit_delay', 'autovacuum')`,
    );
    const settings = Object.fromEntries(rows.map((row) => [row.name, row.setting]));
    const url = new URL(admin);
    return {
      version: settings.server_version ?? 'unknown',
      settings,
      where: databaseUrl === undefined ? `embedded cluster under ${dataDir}/bench-postgres` : `${url.hostname}:${url.port || 5432}`,
    };
  });
  const postmasterPid = await withClient(admin, async (client) => {
    const { rows } = await client.query<{ pid: number }>('select pg_backend_pid() as pid');
    return parentPid(rows[0]!.pid);
  });

  return {
    adminUrl: admin,
    postmasterPid,
    describe,
    urlFor,
    createDatabase: (name, template) =>
      withClient(admin, async (client) => {
        // Cloning a template fails while anything else is connected to it (55006): a just-closed
        // connection may linger for a moment.
        for (let tries = 1; ; tries++) {
          try {
            await client.query(`create database ${name}${template ? ` template ${template}` : ''}`);
            return;
          } catch (error) {
            if ((error as { code?: string }).code !== '55006' || tries >= 20) throw error;
            await new Promise((resolve) => setTimeout(resolve, 100 * tries));
          }
        }
      }),
    dropDatabase: (name) =>
      withClient(admin, async (client) => {
        await client.query(`drop database if exists ${name} with (force)`);
      }),
    stop: stopCluster,
  };
}

export async function withClient<T>(url: string, run: (client: pg.Client) => Promise<T>): Promise<T> {
  const client = new pg.Client({ connectionString: url, application_name: BENCH_APPLICATION_NAME });
  await client.connect();
  try {
    return await run(client);
  } finally {
    await client.end();
  }
}

/** The database's connections, other than the benchmark's own. */
export interface Connections {
  total: number;
  /**
   * LISTEN connections: each process's gateway-listen (it listens first, then runs only its
   * liveness round trips), or any connection whose last statement was a LISTEN.
   */
  listening: number;
  byApplication: Record<string, number>;
}

export async function connectionsOf(client: pg.Client, database: string): Promise<Connections> {
  const { rows } = await client.query<{ application_name: string; listening: boolean; count: string }>(
    `select application_name, (application_name = 'gateway-listen' or query ilike 'listen %') as listening, count(*) as count
     from pg_stat_activity
     where datname = $1 and application_name <> $2 and backend_type = 'client backend'
     group by 1, 2 order by 1`,
    [database, BENCH_APPLICATION_NAME],
  );
  const byApplication: Record<string, number> = {};
  let total = 0;
  let listening = 0;
  for (const row of rows) {
    const count = Number(row.count);
    total += count;
    if (row.listening) listening += count;
    const name = row.application_name || '(unnamed)';
    byApplication[name] = (byApplication[name] ?? 0) + count;
  }
  return { total, listening, byApplication };
}

function parentPid(pid: number): number | undefined {
  try {
    // Only if that pid is a Postgres backend here: a remote server's pid means nothing locally.
    if (readFileSync(`/proc/${pid}/comm`, 'latin1').trim() !== 'postgres') return undefined;
    const stat = readFileSync(`/proc/${pid}/stat`, 'latin1');
    return Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
  } catch {
    return undefined; // the server is not on this machine (or not visible to us)
  }
}

