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
  const { rows: server } = await gateway.pool.query<{ version: number; lz4: boolean }>(`
    select current_setting('server_version_num')::int as version,
           coalesce((select 'lz4' = any (enumvals) from pg_settings where name = 'default_toast_compression'), false) as lz4
  `);
  const { version, lz4 } = server[0]!;
  if (version < 140_000) {
    // Postgres 13 compresses with pglz only, and has no per-column setting to check.
    t.notOk(lz4, 'Postgres 13 has no lz4');
    return;
  }
  const { rows } = await gateway.pool.query<{ name: string; compression: string }>(`
    select attname as name, attcompression::text as compression from pg_attribute
    where attrelid = 'gateway.requests'::regclass and attname in ('body', 'result') order by attname
  `);
  const expected = lz4 ? 'l' : '';
  t.same(rows, [{ name: 'body', compression: expected }, { name: 'result', compression: expected }], lz4 ? 'lz4 on both' : 'the server has no lz4: the default on both');
});
