// A database of its own for each test: a clone of the template that `make test` migrated
// (scripts/test.ts), dropped again when the test ends.
import { randomBytes } from 'node:crypto';
import pg from 'pg';
import { createDb, createPool, type Db } from '../../src/db/pool.ts';
import { createLogger } from '../../src/logger.ts';
import type { Teardown } from './teardown.ts';

export function urlForDatabase(url: string, database: string): string {
  const parsed = new URL(url);
  parsed.pathname = `/${database}`;
  return parsed.toString();
}

function harness(): { adminUrl: string; template: string } {
  const adminUrl = process.env.GATEWAY_TEST_ADMIN_URL;
  const template = process.env.GATEWAY_TEST_TEMPLATE;
  if (!adminUrl || !template) {
    throw new Error('Run the tests with `make test` (or `npm test`): it prepares the database they clone.');
  }
  return { adminUrl, template };
}

/** Creates a fresh, migrated database and returns its URL; it is dropped at teardown. */
export async function createTestDatabase(t: Teardown): Promise<string> {
  const { adminUrl, template } = harness();
  const name = `gateway_test_${randomBytes(6).toString('hex')}`;
  await adminQuery(adminUrl, async (client) => {
    // Two clones of one template at the very same moment can collide (55006); try again.
    for (let tries = 1; ; tries++) {
      try {
        await client.query(`create database ${name} template ${template}`);
        return;
      } catch (error) {
        if ((error as { code?: string }).code !== '55006' || tries >= 20) throw error;
        await new Promise((resolve) => setTimeout(resolve, 50 * tries));
      }
    }
  });
  t.teardown(() =>
    adminQuery(adminUrl, async (client) => {
      await client.query(`drop database if exists ${name} with (force)`);
    }),
  );
  return urlForDatabase(adminUrl, name);
}

/**
 * A fresh database (createTestDatabase) with a pool of `max` connections on it, named
 * `applicationName` in pg_stat_activity, and its kysely instance: ended and dropped at teardown.
 */
export async function testDatabasePool(
  t: Teardown,
  applicationName: string,
  max = 2,
): Promise<{ url: string; pool: pg.Pool; db: Db }> {
  const url = await createTestDatabase(t);
  const pool = createPool(url, { max, applicationName, logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  return { url, pool, db: createDb(pool) };
}

/** Runs `run` on a connection of its own to `url` (as the harness's admin role, unless `url` names
 * another), closed after. */
export async function adminQuery<T>(url: string, run: (client: pg.Client) => Promise<T>): Promise<T> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    return await run(client);
  } finally {
    await client.end();
  }
}
