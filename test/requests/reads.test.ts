// Reading requests by id (requests/reads.ts): many lookups of small results share one statement;
// large results are read apart, a few to a statement within its byte budget; every caller gets
// its own row, result and all.
import t from 'tap';
import { newRequestId } from '../../src/ids.ts';
import { findRequests } from '../../src/requests/read-repository.ts';
import { createRequestReads } from '../../src/requests/reads.ts';
import { startTestGateway } from '../helpers/gateway.ts';

const MiB = 1024 * 1024;

t.test('small results are read with their requests, many to a statement; large ones apart, within the byte budget', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const small = Array.from({ length: 300 }, () => newRequestId());
  const large = Array.from({ length: 5 }, () => newRequestId());
  const queued = newRequestId();
  const plant = (ids: string[], status: string, result: (n: string) => string) =>
    gateway.pool.query(
      `insert into gateway.requests (id, project_id, mode, api_key_id, status, attempts, model, body, body_sha256, result, finished_at)
       select ids.id, keys.project_id, keys.mode, keys.id, $3, 1, 'test-echo', '{}', sha256('{}'), (${result('ids.n')})::json,
              case when $3 = 'completed' then now() end
       from unnest($1::text[]) with ordinality as ids(id, n), gateway.api_keys as keys
       where keys.id = $2`,
      [ids, key.id, status],
    );
  await plant(small, 'completed', (n) => `'{"id":"chatcmpl-' || ${n} || '","choices":[]}'`);
  await plant(large, 'completed', (n) => `'{"id":"chatcmpl-' || ${n} || '","padding":"' || repeat('x', ${MiB - 100}) || '"}'`);
  await plant([queued], 'queued', () => 'null');
  const absent = newRequestId();

  // A budget of 2 MiB: results up to 4 KiB (2 MiB / 500) come with their requests, and those
  // of (just under) 1 MiB two to a statement.
  const reads = createRequestReads(gateway.db, { maxInFlight: 1, maxBytes: 2 * MiB });
  let checkouts = 0;
  gateway.pool.on('acquire', () => checkouts++);
  const all = [...small, ...large, queued, absent];
  const rows = await Promise.all(all.map((id) => reads.submit(id)));

  small.forEach((id, i) => {
    if (rows[i]?.id !== id || rows[i]?.result !== `{"id":"chatcmpl-${i + 1}","choices":[]}`) t.fail(`small ${id}: ${JSON.stringify(rows[i])}`);
  });
  large.forEach((id, i) => {
    const row = rows[small.length + i];
    t.equal(row?.id, id);
    t.equal(row?.status, 'completed');
    t.equal(row?.result?.length, MiB - 100 + `{"id":"chatcmpl-${i + 1}","padding":""}`.length, `large ${i + 1}: its whole result`);
    t.ok(row?.result?.startsWith(`{"id":"chatcmpl-${i + 1}",`), 'its own');
  });
  t.match(rows.at(-2), { id: queued, status: 'queued', result: null });
  t.equal(rows.at(-1), undefined, 'an unknown id: undefined');
  t.notOk(rows.some((row) => row && 'result_bytes' in row), 'rows as the service knows them');

  t.ok(reads.stats.statements <= 3, `${all.length} requests read in ${reads.stats.statements} statements`);
  const resultStatements = checkouts - reads.stats.statements;
  t.equal(resultStatements, 3, 'the 5 large results read apart, in 3 statements of 2 MiB at most');
});

t.test('a result is sized by the size stored with it, and one stored without a size by measuring it', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const key = await gateway.createKey();
  const [stored, measured] = [newRequestId(), newRequestId()];
  const result = '{"id":"chatcmpl-1","choices":[]}';
  // The same small result; the first row says it is 1 MiB, the second says nothing.
  await gateway.pool.query(
    `insert into gateway.requests (id, project_id, mode, api_key_id, status, attempts, model, body, body_sha256, result, result_bytes, finished_at)
     select ids.id, keys.project_id, keys.mode, keys.id, 'completed', 1, 'test-echo', '{}', sha256('{}'), $3::json, ids.bytes, now()
     from unnest($1::text[], $4::int[]) as ids(id, bytes), gateway.api_keys as keys
     where keys.id = $2`,
    [[stored, measured], key.id, result, [MiB, null]],
  );
  const heads = await findRequests(gateway.db, [stored, measured], 4096);
  t.match(heads, [
    { id: stored, result_bytes: MiB, result: null },
    { id: measured, result_bytes: result.length, result },
  ], 'the first left out of its group as 1 MiB, the second measured and read with it');
});
