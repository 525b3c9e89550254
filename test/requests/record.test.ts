// The record as an HTTP body: a large result is written into a Buffer, byte for byte the JSON
// text the record is everywhere else.
import t from 'tap';
import { recordBody, recordJson, type RecordRow } from '../../src/requests/record.ts';

const row = (result: string | null, status: RecordRow['status'] = 'completed'): RecordRow => ({
  id: 'req_0123456789abcdef0123456789abcdef',
  status,
  attempts: 1,
  created_at: new Date('2026-11-26T10:00:00.000Z'),
  updated_at: new Date('2026-11-26T10:00:01.500Z'),
  last_error_code: null,
  result,
});

t.test('a large result, with characters of two, three and four bytes: the Buffer holds the same JSON as the text', async (t) => {
  const content = 'é€😀x'.repeat(40_000);
  const completed = row(JSON.stringify({ id: 'chatcmpl-1', choices: [{ message: { role: 'assistant', content } }] }));
  const body = recordBody(completed);
  t.ok(Buffer.isBuffer(body), 'written as bytes');
  t.same(body, Buffer.from(recordJson(completed)), 'byte for byte the record');
  t.equal(JSON.parse(body.toString('utf8')).result.choices[0].message.content, content, 'its result whole');
});

t.test('a small result, or none, is the JSON text itself', async (t) => {
  const small = row('{"id":"chatcmpl-2","choices":[]}');
  t.equal(recordBody(small), recordJson(small));
  t.same(JSON.parse(recordJson(small)).result, { id: 'chatcmpl-2', choices: [] });
  const queued = row(null, 'queued');
  t.equal(recordBody(queued), recordJson(queued));
  t.notOk('result' in JSON.parse(recordJson(queued)), 'no result until completed');
});
