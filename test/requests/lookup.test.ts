// GET /v1/requests/{id} (docs/api.md, "Looking up a request"): the record's exact fields, and
// 404 for anything the caller may not see, whether unknown, malformed, or another project's or
// mode's.
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { waitForRow } from '../helpers/rows.ts';

const ISO_UTC = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$/;

t.test('the record has exactly the contract fields, and result only when completed', async (t) => {
  const gateway = await startTestGateway(t);
  const client = clientFor(gateway.url, await gateway.createKey());

  const completed = await client.post({ model: 'test-echo', messages: userMessage('record me'), wait: true });
  t.equal(completed.status, 200);
  const { rows } = await gateway.pool.query('select id from gateway.requests');
  const record = await client.get(rows[0].id);
  t.equal(record.status, 200);
  t.same(Object.keys(record.body), ['id', 'status', 'attempts', 'created_at', 'updated_at', 'last_error_code', 'result']);
  t.equal(record.body.id, rows[0].id);
  t.equal(record.body.status, 'completed');
  t.equal(record.body.attempts, 1);
  t.equal(record.body.last_error_code, null);
  t.match(record.body.created_at, ISO_UTC);
  t.match(record.body.updated_at, ISO_UTC);
  t.ok(record.body.updated_at >= record.body.created_at);
  t.same(record.body.result, completed.body, 'result is the completion the wait=true caller got');

  const failed = await client.post({ model: 'test-error-401', messages: userMessage() });
  await waitForRow(gateway.db, failed.body.id, (row) => row.status === 'failed');
  const failedRecord = await client.get(failed.body.id);
  t.same(Object.keys(failedRecord.body), ['id', 'status', 'attempts', 'created_at', 'updated_at', 'last_error_code']);
  t.equal(failedRecord.body.status, 'failed');
  t.equal(failedRecord.body.last_error_code, 'upstream_auth_error');
});

t.test('a queued request has no result', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  const created = await client.post({ model: 'm', messages: userMessage() });
  const record = await client.get(created.body.id);
  t.same(record.body, {
    id: created.body.id,
    status: 'queued',
    attempts: 0,
    created_at: record.body.created_at,
    updated_at: record.body.updated_at,
    last_error_code: null,
  });
  t.equal(Math.floor(Date.parse(record.body.created_at) / 1000), created.body.created);
});

t.test('unknown and malformed ids are 404 request_not_found', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey());
  for (const id of ['req_00000000000000000000', 'req_short', 'chatcmpl-abc', 'x', `req_${'a'.repeat(41)}`, "req_' or 1=1 --", '%00']) {
    const answer = await client.get(id);
    t.equal(answer.status, 404, `${JSON.stringify(id)}: 404`);
    t.same(answer.body.error, {
      message: answer.body.error.message,
      type: 'not_found_error',
      code: 'request_not_found',
      param: null,
    });
  }
});

t.test("another project's or mode's request is 404, not 403; any key of the same project and mode reads it", async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const owner = await gateway.createKey({ project: 'alpha', mode: 'test' });
  const sameScope = await gateway.createKey({ project: 'alpha', mode: 'test' });
  const otherMode = await gateway.createKey({ project: 'alpha', mode: 'live' });
  const otherProject = await gateway.createKey({ project: 'beta', mode: 'test' });

  const created = await clientFor(gateway.url, owner).post({ model: 'm', messages: userMessage() });
  const unknown = await clientFor(gateway.url, owner).get('req_00000000000000000000');

  t.equal((await clientFor(gateway.url, sameScope).get(created.body.id)).status, 200, 'same project and mode');
  for (const [name, key] of [['other mode', otherMode], ['other project', otherProject]] as const) {
    const answer = await clientFor(gateway.url, key).get(created.body.id);
    t.equal(answer.status, 404, `${name}: 404`);
    t.same(answer.body, unknown.body, `${name}: indistinguishable from an unknown id`);
  }
});
