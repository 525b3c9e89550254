// The node:http servers the apps are served on: limits that keep broken or hostile clients from
// holding sockets, the contract's error shape for requests too broken to reach an app, and a
// close that lets in-flight requests finish.
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import type { Duplex } from 'node:stream';
import { setTimeout as sleep } from 'node:timers/promises';
import { ApiError, invalidRequest } from '../errors.ts';

/** How long the server keeps an idle keep-alive connection open. */
export const KEEP_ALIVE_TIMEOUT_MS = 65_000;

/** Each server's requests not yet answered, and whether it is closing (closeServer). */
const servers = new WeakMap<http.Server, { unanswered: Set<http.ServerResponse>; closing: boolean }>();

export function listen(handler: http.RequestListener, port: number, host: string): Promise<http.Server> {
  const state = { unanswered: new Set<http.ServerResponse>(), closing: false };
  const server = http.createServer(
    {
      // Hostile or broken clients may not hold a socket open without sending a request.
      headersTimeout: 10_000,
      requestTimeout: 30_000,
      // An idle connection is closed by the server only long after any client or proxy in front
      // would stop reusing it (Node's fetch after 3 s, load balancers after 60 s). A request sent
      // on a connection as the server closes it is lost with a reset, which a client cannot
      // safely retry for a POST; and a process held off the CPU for a few seconds (a busy host)
      // closes, as it wakes, the connections its clients reused meanwhile, unread requests and all.
      keepAliveTimeout: KEEP_ALIVE_TIMEOUT_MS,
      maxHeaderSize: 16 * 1024,
    },
    (request, response) => {
      if (state.closing) response.shouldKeepAlive = false;
      state.unanswered.add(response);
      response.once('close', () => state.unanswered.delete(response));
      handler(request, response);
    },
  );
  servers.set(server, state);
  server.maxHeadersCount = 100;
  server.on('clientError', answerClientError);
  return new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, host, () => {
      server.off('error', reject);
      resolve(server);
    });
  });
}

/**
 * Requests too broken to reach the app (unparseable HTTP, oversized headers) still get the
 * contract's error shape; a client too slow to send its request just loses the connection.
 */
function answerClientError(error: Error & { code?: string }, socket: Duplex): void {
  if (!socket.writable || error.code === 'ECONNRESET') {
    socket.destroy();
    return;
  }
  if (error.code === 'ERR_HTTP_REQUEST_TIMEOUT') {
    socket.end();
    return;
  }
  const apiError =
    error.code === 'HPE_HEADER_OVERFLOW'
      ? new ApiError(413, 'invalid_request_error', 'request_too_large', 'The request headers are too large.')
      : invalidRequest('invalid_body', 'The request is not valid HTTP/1.1.');
  const body = JSON.stringify(apiError.toBody());
  socket.end(
    `HTTP/1.1 ${apiError.status} ${http.STATUS_CODES[apiError.status]}\r\n` +
      `content-type: application/json; charset=utf-8\r\ncontent-length: ${Buffer.byteLength(body)}\r\n` +
      `connection: close\r\n\r\n${body}`,
  );
}

/** How long a close waits at most for answers written but not yet sent in full (closeServer). */
const SENDING_GRACE_MS = 5_000;

/**
 * Stops accepting, closes idle keep-alive sockets, and resolves when in-flight requests are
 * answered: their answers, and those of requests that still come on open connections, say
 * `Connection: close`, and each connection closes once its answer is sent (rather than being
 * kept for another request for KEEP_ALIVE_TIMEOUT_MS).
 *
 * Node's close ends at once every connection whose request it has read and whose answer is
 * written, even if that answer is still being sent (a large one, or to a client slow to read):
 * the client would get it cut short. Such answers are let finish first, for SENDING_GRACE_MS at
 * most, before the close.
 */
export function closeServer(server: http.Server): Promise<void> {
  const state = servers.get(server);
  if (state) {
    state.closing = true;
    for (const response of state.unanswered) response.shouldKeepAlive = false;
  }
  return (async () => {
    const giveUpAt = Date.now() + SENDING_GRACE_MS;
    for (;;) {
      const sending = [...(state?.unanswered ?? [])].filter((response) => response.writableEnded && !response.writableFinished);
      const left = giveUpAt - Date.now();
      if (sending.length === 0 || left <= 0) break;
      await Promise.race([Promise.all(sending.map(sent)), sleep(left, undefined, { ref: false })]);
    }
    await new Promise<void>((resolve) => {
      server.close(() => resolve());
      server.closeIdleConnections();
    });
  })();
}

/** Resolves once the answer is sent in full, or its connection is gone. */
function sent(response: http.ServerResponse): Promise<void> {
  return new Promise((resolve) => {
    response.once('finish', () => resolve());
    response.once('close', () => resolve());
  });
}

/** The server's base URL ('' for no server). */
export function urlOf(server: http.Server | undefined): string {
  const address = server?.address() as AddressInfo | null | undefined;
  return address ? `http://${hostForUrl(address)}:${address.port}` : '';
}

function hostForUrl(address: AddressInfo): string {
  if (address.address === '0.0.0.0' || address.address === '::') return '127.0.0.1';
  return address.family === 'IPv6' ? `[${address.address}]` : address.address;
}
