// The service's pools plan each prepared statement once per connection, and compile none to
// machine code (db/pool.ts, SESSION_SETTINGS): a statement over a group of rows is run on its
// generic plan from its first run, where Postgres would otherwise plan it afresh for each run's
// arrays, and however high that plan's estimated cost, it is not compiled. A command's pool
// leaves Postgres to plan each of its statements for its values.
import type pg from 'pg';
import t from 'tap';
import { createPool } from '../../src/db/pool.ts';
import { createLogger } from '../../src/logger.ts';
import { adminQuery, createTestDatabase } from '../helpers/database.ts';

// A grouped statement of the kind the request path runs: the group's ids as an array.
const GROUPED = `select requests.id, requests.status
  from unnest($1::text[]) with ordinality as input(id, ord)
  join gateway.requests on requests.id = input.id`;

/** The plan a connection runs for `EXECUTE grouped(<ids>)`, in EXPLAIN's text. */
async function planOf(client: pg.PoolClient, ids: string[]): Promise<string> {
  const { rows } = await client.query<{ 'QUERY PLAN': string }>(`explain (verbose) execute grouped('{${ids.join(',')}}')`);
  return rows.map((row) => row['QUERY PLAN']).join('\n');
}

t.test('every connection of a service pool runs a grouped statement on its generic plan, never compiled', async (t) => {
  const url = await createTestDatabase(t);
  // Whether this server can compile statements to machine code at all (as a connection with the
  // server's settings sees it: pg_jit_available() is false where jit is off).
  const canCompile = await adminQuery(url, async (client) => {
    const { rows } = await client.query<{ available: boolean }>('select pg_jit_available() as available');
    return rows[0]!.available;
  });
  const pool = createPool(url, { max: 3, applicationName: 'generic-plans-test', logger: createLogger({ logLevel: 'silent' }) });
  t.teardown(() => pool.end());
  // Three connections at once: each is a new one, set up on its own.
  const clients = await Promise.all([pool.connect(), pool.connect(), pool.connect()]);
  t.teardown(() => clients.forEach((client) => client.release()));
  for (const [index, client] of clients.entries()) {
    // Postgres compiles a plan that costs more than jit_above_cost: here, any plan made from now on.
    await client.query('set jit_above_cost = 0');
    await client.query(`prepare grouped(text[]) as ${GROUPED}`);
    const first = await planOf(client, ['req_one', 'req_two']);
    t.match(first, /\$1/, `connection ${index + 1}: the first run's plan takes the array as a parameter (a generic plan)`);
    t.notMatch(first, /req_one/, `connection ${index + 1}: and was not made for its values`);
    const { rows } = await client.query<{ jit: string }>(`select current_setting('jit') as jit`);
    t.equal(rows[0]!.jit, 'off', `connection ${index + 1}: compiles no statement to machine code`);
    if (canCompile) {
      const analyzed = await client.query<{ 'QUERY PLAN': string }>(`explain (analyze) execute grouped('{req_one}')`);
      t.notMatch(analyzed.rows.map((row) => row['QUERY PLAN']).join('\n'), /JIT/, `connection ${index + 1}: not even a plan over jit_above_cost`);
    } else {
      t.pass(`connection ${index + 1}: not even a plan over jit_above_cost`, {
        skip: 'this server cannot compile statements (pg_jit_available() is false)',
      });
    }
  }
});

t.test("a command's pool has each statement planned for its values", async (t) => {
  const url = await createTestDatabase(t);
  const pool = createPool(url, { max: 1, applicationName: 'generic-plans-test', logger: createLogger({ logLevel: 'silent' }), sessionSettings: false });
  t.teardown(() => pool.end());
  const client = await pool.connect();
  t.teardown(() => client.release());
  await client.query(`prepare grouped(text[]) as ${GROUPED}`);
  t.match(await planOf(client, ['req_one', 'req_two']), /req_one/, 'the plan was made for the values of the run');
});
