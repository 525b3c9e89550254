// ApiError: a 4xx carries no stack (it is an answer, and clients may send thousands of bad
// requests a second); a 5xx keeps its stack for the log.
import t from 'tap';
import { ApiError, invalidRequest } from '../src/errors.ts';

t.test('a 4xx ApiError has no stack frames; a 5xx has them; other errors keep theirs', async (t) => {
  const limit = Error.stackTraceLimit;
  const refused = invalidRequest('invalid_parameter', 'nope', 'model');
  t.equal(refused.stack, 'ApiError: nope', 'the 4xx: its name and message only');
  t.same(refused.toBody(), { error: { message: 'nope', type: 'invalid_request_error', code: 'invalid_parameter', param: 'model' } });
  const busy = new ApiError(503, 'api_error', 'busy', 'try later');
  t.match(busy.stack, /^ApiError: try later\n\s+at /, 'the 5xx: with its frames');
  t.equal(Error.stackTraceLimit, limit, 'the stack trace limit is as it was');
  t.match(new Error('other').stack, /\n\s+at /);
});
