// The schema explains itself in psql (\d+): every column of every table and view of the gateway
// schema has a comment saying what it is.
import t from 'tap';
import { startTestGateway } from './helpers/gateway.ts';

t.test('every column of the gateway schema has a comment', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const { rows } = await gateway.pool.query<{ relation: string; kind: string; columns: number; uncommented: string[] }>(`
    select relation.relname as relation, relation.relkind::text as kind, count(*)::int as columns,
           array_remove(array_agg(case when col_description(relation.oid, attribute.attnum) is null then attribute.attname::text end), null) as uncommented
    from pg_class as relation
    join pg_namespace on pg_namespace.oid = relation.relnamespace
    join pg_attribute as attribute on attribute.attrelid = relation.oid and attribute.attnum > 0 and not attribute.attisdropped
    where pg_namespace.nspname = 'gateway' and relation.relkind in ('r', 'v')
    group by relation.relname, relation.relkind
    order by relation.relname
  `);
  t.ok(rows.filter((row) => row.kind === 'r').length >= 13 && rows.filter((row) => row.kind === 'v').length >= 7, 'every table and view is looked at');
  for (const row of rows) t.same(row.uncommented, [], `${row.relation}: its ${row.columns} columns are commented`);
});

t.test('request bodies and results are compressed with lz4 on a server that has it, and with its default elsewhere', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const { rows: settings } = await gateway.pool.query<{ lz4: boolean }>(
    `select coalesce(bool_or('lz4' = any (enumvals)), false) as lz4 from pg_settings where name = 'default_toast_compression'`,
  );
  const { rows } = await gateway.pool.query<{ name: string; compression: string }>(`
    select attname as name, attcompression::text as compression from pg_attribute
    where attrelid = 'gateway.requests'::regclass and attname in ('body', 'result') order by attname
  `).catch(() => ({ rows: [] as { name: string; compression: string }[] })); // attcompression: Postgres 14 and newer
  const expected = settings[0]!.lz4 ? 'l' : '';
  t.same(
    rows,
    rows.length === 0 ? [] : [{ name: 'body', compression: expected }, { name: 'result', compression: expected }],
    settings[0]!.lz4 ? 'lz4 on both' : 'the server has no lz4: the default on both',
  );
});
