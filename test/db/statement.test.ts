// A statement built once (db/statement.ts): its text is compiled on its first run, with a
// numbered placeholder for each named value, and every run binds only the values.
import { sql } from 'kysely';
import t from 'tap';
import { statement } from '../../src/db/statement.ts';
import { testDatabasePool } from '../helpers/database.ts';

t.test('a statement is built once, binds each run its own values, and is prepared once', async (t) => {
  // One connection, so that every run below is on the one whose prepared statements are read.
  const { pool, db } = await testDatabasePool(t, 'statement-test', 1);
  let builds = 0;
  const sums = statement(['a', 'b'] as const, (v) => {
    builds++;
    return sql<{ sum: number; twice: number; label: string }>`
      select ${v.a}::int + ${v.b}::int as sum, ${v.a}::int * 2 as twice, ${sql.lit('built once')} as label`;
  });

  t.same((await sums.execute(db, { a: 1, b: 2 })).rows, [{ sum: 3, twice: 2, label: 'built once' }], 'the first run');
  t.same((await sums.execute(db, { a: 5, b: 7 })).rows, [{ sum: 12, twice: 10, label: 'built once' }], 'a second run, other values');
  t.same((await sums.execute(db, { b: 0, a: -4 })).rows, [{ sum: -4, twice: -8, label: 'built once' }], 'values bound by name, not by their order');
  t.equal(builds, 1, 'its text was built on the first run only');

  const { rows } = await pool.query<{ count: string }>(`select count(*) from pg_prepared_statements where statement like '%built once%'`);
  t.equal(Number(rows[0]!.count), 1, 'the connection prepared it once');
});

t.test('a template that holds a value of its own, rather than a named placeholder, is refused', async (t) => {
  const { db } = await testDatabasePool(t, 'statement-refused-test', 1);
  const mixed = statement(['a'] as const, (v) => sql<{ n: number }>`select ${v.a}::int + ${5}::int as n`);
  await t.rejects(mixed.execute(db, { a: 1 }), /values must be named placeholders; its template holds 1 other values/);
});
