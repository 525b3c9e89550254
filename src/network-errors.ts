// A connection that could not be made or was lost, as Node and undici report it: an error code,
// on the error or on one of its causes. One list of those codes, with our words for each, for
// the database pool (is the database out of reach?), the upstream calls and the webhook tries.

/** What a code says of the connection: in our words, and whether it waited for an answer until a timeout. */
interface Unreachable {
  says: string;
  timedOut: boolean;
}

const said = (says: string, timedOut = false): Unreachable => ({ says, timedOut });
const CLOSED = said('the connection was closed before an answer');
const NO_CONNECTION_IN_TIME = said('no connection within the timeout', true);
const HOST_UNREACHABLE = said('the host is unreachable');

/** Codes of a peer out of reach: Node's socket and DNS errors, and undici's own. */
const UNREACHABLE: ReadonlyMap<string, Unreachable> = new Map([
  ['ECONNREFUSED', said('connection refused')],
  ['ECONNRESET', CLOSED],
  ['EPIPE', CLOSED],
  ['UND_ERR_SOCKET', CLOSED],
  ['ENOTFOUND', said('the host name does not resolve')],
  ['EAI_AGAIN', said('the host name could not be resolved (DNS lookup failed)')],
  ['ETIMEDOUT', NO_CONNECTION_IN_TIME],
  ['UND_ERR_CONNECT_TIMEOUT', NO_CONNECTION_IN_TIME],
  ['EHOSTUNREACH', HOST_UNREACHABLE],
  ['ENETUNREACH', HOST_UNREACHABLE],
]);

/** OpenSSL's and Node's codes of a TLS handshake that failed (a certificate refused, say). */
const TLS_CODE = /^(ERR_TLS_|ERR_SSL_|CERT_|UNABLE_TO_|DEPTH_ZERO_|SELF_SIGNED_)/;

/** The error, or one of its causes (or of an AggregateError's errors), that satisfies `test`. */
export function findCause(error: unknown, test: (cause: unknown) => boolean, depth = 0): unknown {
  if (error === undefined || error === null || depth > 5) return undefined;
  if (test(error)) return error;
  if (error instanceof AggregateError) {
    for (const inner of error.errors) {
      const found = findCause(inner, test, depth + 1);
      if (found) return found;
    }
  }
  return error instanceof Error ? findCause(error.cause, test, depth + 1) : undefined;
}

/** The error's own `code`, when it is a string. */
const ownCode = (error: unknown): string | undefined => {
  const code = (error as { code?: unknown } | null | undefined)?.code;
  return typeof code === 'string' ? code : undefined;
};

/** The first string `code` of the error or of its causes. */
export function errorCode(error: unknown): string | undefined {
  return ownCode(findCause(error, (cause) => ownCode(cause) !== undefined));
}

/** Whether the error, or one of its causes, is a connection that could not be made or was lost. */
export function isUnreachable(error: unknown): boolean {
  return findCause(error, (cause) => UNREACHABLE.has(ownCode(cause) ?? '')) !== undefined;
}

/** Whether the error, or one of its causes, is a TLS handshake that failed (TLS_CODE). */
export function isTlsFailure(error: unknown): boolean {
  return findCause(error, (cause) => TLS_CODE.test(ownCode(cause) ?? '')) !== undefined;
}

/**
 * Why a connection failed, in our words: `known` is false for a code (or none) that is not one of
 * a peer out of reach nor of TLS, which is then only named.
 */
export function connectionFailure(error: unknown): { code: string | undefined; says: string; timedOut: boolean; known: boolean } {
  const code = errorCode(error);
  const unreachable = code === undefined ? undefined : UNREACHABLE.get(code);
  if (unreachable) return { code, ...unreachable, known: true };
  if (code !== undefined && TLS_CODE.test(code)) return { code, says: `TLS failed: ${code}`, timedOut: false, known: true };
  return { code, says: `connection failed: ${code ?? 'unknown error'}`, timedOut: false, known: false };
}
