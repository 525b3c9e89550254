// One reading of a connection's failure: the code found through causes, whether the peer is out
// of reach, and our words for it.
import t from 'tap';
import { connectionFailure, errorCode, isUnreachable } from '../src/network-errors.ts';

const withCode = (code: string, message = `failed: ${code}`) => Object.assign(new Error(message), { code });

t.test('the code is the first of the error and its causes, and the errors of an AggregateError', async (t) => {
  t.equal(errorCode(withCode('ECONNREFUSED')), 'ECONNREFUSED');
  t.equal(errorCode(new TypeError('fetch failed', { cause: withCode('ECONNRESET') })), 'ECONNRESET');
  t.equal(errorCode(new Error('outer', { cause: new Error('middle', { cause: withCode('ENOTFOUND') }) })), 'ENOTFOUND');
  t.equal(errorCode(new AggregateError([new Error('no code'), withCode('EHOSTUNREACH')])), 'EHOSTUNREACH');
  t.equal(errorCode(withCode('UND_ERR_SOCKET')), 'UND_ERR_SOCKET', 'its own first');
  t.equal(errorCode(new Error('none')), undefined);
  t.equal(errorCode('ECONNREFUSED'), undefined, 'a string is no error');
  t.equal(errorCode(undefined), undefined);
});

t.test('a peer out of reach, by the code of the error or of a cause', async (t) => {
  const codes = ['ECONNREFUSED', 'ECONNRESET', 'EPIPE', 'UND_ERR_SOCKET', 'ENOTFOUND', 'EAI_AGAIN', 'ETIMEDOUT', 'UND_ERR_CONNECT_TIMEOUT', 'EHOSTUNREACH', 'ENETUNREACH'];
  for (const code of codes) {
    t.ok(isUnreachable(withCode(code)), code);
    t.ok(isUnreachable(new Error('wrapped', { cause: withCode(code) })), `${code} as a cause`);
  }
  t.ok(isUnreachable(Object.assign(new Error('wrapper'), { code: 'ERR_WRAPPED', cause: withCode('ECONNRESET') })), 'a cause further down counts');
  t.notOk(isUnreachable(withCode('ENOENT')));
  t.notOk(isUnreachable(withCode('CERT_HAS_EXPIRED')), 'a refused certificate is a peer that answered');
  t.notOk(isUnreachable(new Error('no code')));
});

t.test('our words for each failure, and whether it waited until a timeout', async (t) => {
  t.same(connectionFailure(withCode('ECONNREFUSED')), { code: 'ECONNREFUSED', says: 'connection refused', timedOut: false, known: true });
  t.match(connectionFailure(withCode('ECONNRESET')), { says: 'the connection was closed before an answer', timedOut: false });
  t.match(connectionFailure(withCode('UND_ERR_SOCKET')), { says: 'the connection was closed before an answer' });
  t.match(connectionFailure(withCode('ENOTFOUND')), { says: 'the host name does not resolve' });
  t.match(connectionFailure(withCode('EAI_AGAIN')), { says: 'the host name could not be resolved (DNS lookup failed)' });
  t.match(connectionFailure(withCode('UND_ERR_CONNECT_TIMEOUT')), { says: 'no connection within the timeout', timedOut: true });
  t.match(connectionFailure(withCode('ETIMEDOUT')), { timedOut: true });
  t.match(connectionFailure(withCode('ENETUNREACH')), { says: 'the host is unreachable' });
  t.same(connectionFailure(withCode('CERT_HAS_EXPIRED')), { code: 'CERT_HAS_EXPIRED', says: 'TLS failed: CERT_HAS_EXPIRED', timedOut: false, known: true });
  t.same(connectionFailure(withCode('EPROTO')), { code: 'EPROTO', says: 'connection failed: EPROTO', timedOut: false, known: false });
  t.same(connectionFailure(new Error('no code')), { code: undefined, says: 'connection failed: unknown error', timedOut: false, known: false });
});
