// The service's pools plan each prepared statement once per connection (db/pool.ts,
// GENERIC_PLANS): a statement over a group of rows is run on its generic plan from its first run,
// where Postgres would otherwise plan it afresh for each run's arrays. A command's pool leaves
// Postgres to plan each of its statements for its values.
import type pg from 'pg';
import t from 'tap';
import { createPool } from '../../src/db/pool.ts';
import { createLogger } from '../../src/logger.ts';
import { createTestDatabase } from '../helpers/database.ts';

// A grouped statement of the kind the request path runs: the group's ids as an array.
const GROUPED = `select requests.id, requests.status
  from unnest($1::text[]) with ordinality as input(id, ord)
  join gateway.requests on requests.id = input.id`;

/** The plan a connection runs for `EXECUTE grouped(<ids>)`, in EXPLAIN's text. */
async function planOf(client: pg.PoolClient, ids: string[]): Promise<string> {
  const { rows } = await client.query<{ 'QUERY PLAN': string }>(`explain (verbose) execute grouped('{${ids.join(',')}}')`);
  return rows.map((row) => row['QUERY PLAN']).join('\n');
}

t.test('every connection of a service pool runs a grouped statement on its generic plan', async (t) => {
  const url = await createTestDatabase(t);
  const pool = createPool(url, { max: 3, applicationName: 'generic-plans-test', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  // Three connections at once: each is a new one, set up on its own.
  const clients = await Promise.all([pool.connect(), pool.connect(), pool.connect()]);
  t.teardown(() => clients.forEach((client) => client.release()));
  for (const [index, client] of clients.entries()) {
    await client.query(`prepare grouped(text[]) as ${GROUPED}`);
    const first = await planOf(client, ['req_one', 'req_two']);
    t.match(first, /\$1/, `connection ${index + 1}: the first run's plan takes the array as a parameter (a generic plan)`);
    t.notMatch(first, /req_one/, `connection ${index + 1}: and was not made for its values`);
  }
});

t.test("a command's pool has each statement planned for its values", async (t) => {
  const url = await createTestDatabase(t);
  const pool = createPool(url, { max: 1, applicationName: 'generic-plans-test', logger: createLogger({ logLevel: 'silent' }), genericPlans: false });
  t.teardown(() => pool.end());
  const client = await pool.connect();
  t.teardown(() => client.release());
  await client.query(`prepare grouped(text[]) as ${GROUPED}`);
  t.match(await planOf(client, ['req_one', 'req_two']), /req_one/, 'the plan was made for the values of the run');
});
