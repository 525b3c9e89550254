// The node:http servers the apps are served on: limits that keep broken or hostile clients from
// holding sockets, sockets enough to listen on that a flood of new connections does not hold
// everyone else's behind it, the contract's error shape for requests too broken to reach an app,
// and a close that lets in-flight requests finish.
import cluster from 'node:cluster';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import type net from 'node:net';
import type { Duplex } from 'node:stream';
import { setTimeout as sleep } from 'node:timers/promises';
import { ApiError, invalidRequest, methodNotAllowed } from '../errors.ts';

/** How long the server keeps an idle keep-alive connection open. */
export const KEEP_ALIVE_TIMEOUT_MS = 65_000;

/**
 * Sockets a server listens on, all on its port (SO_REUSEPORT), where the platform has it. libuv
 * accepts one connection per listening socket in a turn of the event loop, and a turn of a busy
 * process takes tens of milliseconds: a client that opens hundreds of connections at once fills a
 * single socket's queue of connections to accept, and every other client's new connection waits
 * behind them, first in first out, for seconds. Over 16 sockets, the kernel spreads new
 * connections over 16 queues, and a turn accepts up to 16 of them.
 */
export const LISTENING_SOCKETS = 16;

interface ServerState {
  /** Requests not yet answered, on any of the server's sockets. */
  unanswered: Set<http.ServerResponse>;
  /** Open connections, on any of the server's sockets. */
  connections: Set<Duplex>;
  closing: boolean;
  /** The servers of its other listening sockets (LISTENING_SOCKETS). */
  siblings: http.Server[];
  onAnswer: OnAnswer | undefined;
}

/**
 * Told of each answer a server gives itself, its request never given to the handler: `method`
 * is 'unknown' when the request could not be parsed.
 */
export type OnAnswer = (method: string, status: number) => void;

/** Each server's state (closeServer), the same for the servers of its other sockets. */
const servers = new WeakMap<http.Server, ServerState>();

/**
 * Serves `handler` on port and host: on LISTENING_SOCKETS sockets sharing the port, or one where
 * the platform cannot share it or the process is an API process of a cluster (its primary
 * accepts the connections). The server returned stands for all of them (closeServer, urlOf).
 * A port already in use is refused (EADDRINUSE) as by a single socket, even when whoever holds it
 * would share it. `onAnswer` hears of the answers the server gives without the handler.
 */
export async function listen(handler: http.RequestListener, port: number, host: string, onAnswer?: OnAnswer): Promise<http.Server> {
  const state: ServerState = { unanswered: new Set(), connections: new Set(), closing: false, siblings: [], onAnswer };
  const serve = () => {
    const server = createServer(handler, state);
    servers.set(server, state);
    return server;
  };
  const server = serve();
  if (cluster.isWorker) return bind(server, { port, host });
  // Sockets that share a port bind where another sharing one is bound: one that does not share
  // it tells whether the port is free.
  if (port !== 0) await unbind(await bind(http.createServer(), { port, host }));
  try {
    await bind(server, { port, host, reusePort: true });
  } catch (error) {
    if ((error as { code?: string }).code !== 'ENOTSUP') throw error;
    return bind(server, { port, host });
  }
  const shared = (server.address() as AddressInfo).port;
  try {
    for (let i = 1; i < LISTENING_SOCKETS; i++) state.siblings.push(await bind(serve(), { port: shared, host, reusePort: true }));
  } catch (error) {
    await Promise.all([server, ...state.siblings].map(unbind));
    throw error;
  }
  return server;
}

function createServer(handler: http.RequestListener, state: ServerState): http.Server {
  const onRequest: http.RequestListener = (request, response) => {
    if (state.closing) response.shouldKeepAlive = false;
    state.unanswered.add(response);
    response.once('close', () => state.unanswered.delete(response));
    if (request.httpVersion === '1.1' && request.headers.host === undefined) {
      refuse(response, invalidRequest('invalid_body', 'The request is not valid HTTP/1.1: it has no Host header.'));
      state.onAnswer?.(request.method ?? 'unknown', 400);
      return;
    }
    response.once('finish', () => {
      if (!request.complete) closeUnlessComplete(request, BODY_AFTER_ANSWER_MS);
    });
    handler(request, response);
  };
  const server = http.createServer(
    {
      // Hostile or broken clients may not hold a socket open without sending a request.
      headersTimeout: 10_000,
      requestTimeout: REQUEST_TIMEOUT_MS,
      // An idle connection is closed by the server only long after any client or proxy in front
      // would stop reusing it (Node's fetch after 3 s, load balancers after 60 s). A request sent
      // on a connection as the server closes it is lost with a reset, which a client cannot
      // safely retry for a POST; and a process held off the CPU for a few seconds (a busy host)
      // closes, as it wakes, the connections its clients reused meanwhile, unread requests and all.
      keepAliveTimeout: KEEP_ALIVE_TIMEOUT_MS,
      maxHeaderSize: 16 * 1024,
      // Node answers an HTTP/1.1 request without Host itself, with an empty 400: it is answered
      // below, in the contract's shape.
      requireHostHeader: false,
    },
    onRequest,
  );
  // An Expect other than 100-continue is ignored (RFC 9110 allows it), and the request served as
  // any other: Node would answer it itself with an empty 417, a status outside the contract.
  server.on('checkExpectation', onRequest);
  // Expect: 100-continue: the client sends the body once told to. Node would tell it at once; the
  // app tells it when it reads the body (body.ts), so that a request refused before (a bad key, a
  // rate limit) is answered without the body ever being sent.
  server.on('checkContinue', onRequest);
  // No route takes CONNECT, which Node hands to no request listener: unheard, it would close the
  // connection without a word.
  server.on('connect', (_request: http.IncomingMessage, socket: Duplex) => {
    endWith(socket, methodNotAllowed());
    state.onAnswer?.('CONNECT', 405);
  });
  server.maxHeadersCount = 100;
  server.on('clientError', (error: Error & { code?: string }, socket: Duplex) => answerClientError(error, socket, state.onAnswer));
  server.on('connection', (socket: Duplex) => {
    state.connections.add(socket);
    socket.once('close', () => state.connections.delete(socket));
  });
  return server;
}

/**
 * How long the rest of a request's body may take to arrive once the request has been answered
 * (closeUnlessComplete).
 */
const BODY_AFTER_ANSWER_MS = 5_000;

/**
 * A request answered before its body was read to its end (refused at once: a bad key, a body
 * too large, a rate limit) leaves the rest of its body on the connection. Node reads it all off
 * and throws it away, to keep the connection for the next request, however much is announced and
 * however slowly it comes, and requestTimeout no longer counts once the answer is sent (a body
 * the app stopped reading, paused, holds the connection as long as it is not idle). The rest is
 * given `ms`: a body still coming then has its connection closed. Closing it at once would not
 * do: a client still sending would get a reset, which may lose it the answer.
 */
function closeUnlessComplete(request: http.IncomingMessage, ms: number): void {
  const socket = request.socket;
  const timer = setTimeout(() => socket.destroy(), ms);
  timer.unref();
  // A keep-alive connection outlives its requests: what one request leaves on it must go when
  // that request is done, or listeners pile up on the socket with each request so answered.
  const done = () => {
    clearTimeout(timer);
    request.off('end', done);
    socket.off('close', done);
  };
  request.once('end', done);
  socket.once('close', done);
  // A body the app stopped reading (past MAX_BODY_BYTES) is read off and thrown away too.
  if (request.isPaused()) request.resume();
}

/** Answers a request the app is not given with an error, and closes its connection. */
function refuse(response: http.ServerResponse, error: ApiError): void {
  const body = JSON.stringify(error.toBody());
  response.shouldKeepAlive = false;
  response.writeHead(error.status, {
    'content-type': 'application/json; charset=utf-8',
    'content-length': Buffer.byteLength(body),
  });
  response.end(body);
}

/** Resolves with the server once it listens; rejects with the error of a listen that failed. */
function bind(server: http.Server, options: { port: number; host: string; reusePort?: boolean }): Promise<http.Server> {
  return new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(options, () => {
      server.off('error', reject);
      resolve(server);
    });
  });
}

/** Stops listening, and ends the server's idle connections; resolves once its connections have all ended. */
function unbind(server: http.Server): Promise<void> {
  return new Promise((resolve) => {
    server.close(() => resolve());
    server.closeIdleConnections();
  });
}

/**
 * Requests too broken to reach the app (unparseable HTTP, oversized headers) still get the
 * contract's error shape; a client too slow to send its request just loses the connection.
 */
function answerClientError(error: Error & { code?: string }, socket: Duplex, onAnswer: OnAnswer | undefined): void {
  if (!socket.writable || error.code === 'ECONNRESET') {
    socket.destroy();
    return;
  }
  if (error.code === 'ERR_HTTP_REQUEST_TIMEOUT') {
    socket.end();
    return;
  }
  const answer =
    error.code === 'HPE_HEADER_OVERFLOW'
      ? new ApiError(413, 'invalid_request_error', 'request_too_large', 'The request headers are too large.')
      : invalidRequest('invalid_body', 'The request is not valid HTTP/1.1.');
  endWith(socket, answer);
  onAnswer?.('unknown', answer.status);
}

/** How long a socket answered by endWith is kept for its client to close its side. */
const CLOSING_GRACE_MS = 5_000;

/**
 * Writes the error as a whole HTTP answer on a socket no ServerResponse holds, and closes it:
 * once the client closes its side, or after CLOSING_GRACE_MS (the server's sockets stay half
 * open, and no timeout of the server counts for a socket it has handed over).
 */
function endWith(socket: Duplex, apiError: ApiError): void {
  const body = JSON.stringify(apiError.toBody());
  socket.end(
    `HTTP/1.1 ${apiError.status} ${http.STATUS_CODES[apiError.status]}\r\n` +
      `content-type: application/json; charset=utf-8\r\ncontent-length: ${Buffer.byteLength(body)}\r\n` +
      `connection: close\r\n\r\n${body}`,
  );
  const timer = setTimeout(() => socket.destroy(), CLOSING_GRACE_MS);
  timer.unref();
  socket.once('close', () => clearTimeout(timer));
}

/** How long a close waits at most for answers written but not yet sent in full (closeServer). */
const SENDING_GRACE_MS = 5_000;

/** How long a request may take to arrive in full (its head and its body). */
const REQUEST_TIMEOUT_MS = 30_000;

/**
 * Stops accepting (on each of the server's sockets), closes idle keep-alive sockets, and resolves
 * when in-flight requests are answered: their answers, and those of requests that still come on
 * open connections, say `Connection: close`, and each connection closes once its answer is sent
 * (rather than being kept for another request for KEEP_ALIVE_TIMEOUT_MS).
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
    const unbound = Promise.all([server, ...(state?.siblings ?? [])].map(unbind));
    if (!state) return void (await unbound);
    // Node enforces headersTimeout and requestTimeout no more once a server is closed, and its
    // close waits for every connection with a request begun: a client that sent part of a request
    // and then nothing would hold it for good. A connection whose request has not reached the
    // handler (part of its head in) has nothing to answer, and is closed now; one whose request
    // has (its body not in full, say) is closed once the whole request could have taken.
    const handled = new Set([...state.unanswered].map((response) => response.socket));
    for (const connection of state.connections) if (!handled.has(connection as net.Socket)) connection.destroy();
    const timer = setTimeout(() => {
      for (const connection of state.connections) connection.destroy();
    }, REQUEST_TIMEOUT_MS);
    await unbound;
    clearTimeout(timer);
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
