// A minimal HTTP/1.1 client over plain sockets, for the load generator only: one request at a
// time per keep-alive connection, requests written as prepared text, responses parsed just far
// enough to know their status, headers and body. It costs far less CPU per request than
// node:http (the machine's two cores are shared with the gateway and Postgres), and it stamps
// each response with the moment its last byte arrived, so latencies are not inflated by the
// event loop running other callbacks first.
import net from 'node:net';

export interface HttpResponse {
  status: number;
  /** The header block, as sent (latin1), without the status line. */
  head: string;
  body: Buffer;
  /** performance.now() when the request was written. */
  sentAt: number;
  /** performance.now() when the last byte of the response arrived. */
  receivedAt: number;
}

export class HttpError extends Error {
  override name = 'HttpError';
}

interface Pending {
  resolve(response: HttpResponse): void;
  reject(error: Error): void;
  sentAt: number;
}

const HEADER_END = Buffer.from('\r\n\r\n');
const CRLF = Buffer.from('\r\n');
const EMPTY = Buffer.alloc(0);

export class HttpConnection {
  readonly #socket: net.Socket;
  #pending: Pending | undefined;
  #buffer: Buffer = EMPTY;
  #closed = false;
  /** performance.now() of the last response (or of the connection), for dropping idle sockets. */
  lastUsedAt = performance.now();

  private constructor(socket: net.Socket) {
    this.#socket = socket;
    socket.setNoDelay(true);
    socket.on('data', (chunk: Buffer) => this.#onData(chunk));
    socket.on('error', (error) => this.#fail(error));
    socket.on('close', () => this.#fail(new HttpError('connection closed by the server')));
  }

  static connect(port: number, host = '127.0.0.1'): Promise<HttpConnection> {
    return new Promise((resolve, reject) => {
      const socket = net.connect({ port, host });
      socket.once('error', reject);
      socket.once('connect', () => {
        socket.off('error', reject);
        resolve(new HttpConnection(socket));
      });
    });
  }

  get closed(): boolean {
    return this.#closed;
  }

  /** Sends one complete request (head and body, prepared by the caller) and resolves with its response. */
  send(request: string): Promise<HttpResponse> {
    if (this.#closed) return Promise.reject(new HttpError('connection is closed'));
    if (this.#pending) return Promise.reject(new HttpError('a request is already in flight on this connection'));
    return new Promise((resolve, reject) => {
      this.#pending = { resolve, reject, sentAt: performance.now() };
      this.#socket.write(request, 'latin1');
    });
  }

  close(): void {
    this.#closed = true;
    this.#socket.destroy();
  }

  #fail(error: Error): void {
    this.#closed = true;
    const pending = this.#pending;
    this.#pending = undefined;
    pending?.reject(error);
    this.#socket.destroy();
  }

  #onData(chunk: Buffer): void {
    this.#buffer = this.#buffer.length === 0 ? chunk : Buffer.concat([this.#buffer, chunk]);
    const pending = this.#pending;
    if (!pending) {
      this.#fail(new HttpError('the server sent bytes with no request in flight'));
      return;
    }
    const parsed = parseResponse(this.#buffer);
    if (parsed === undefined) return;
    if (parsed instanceof Error) {
      this.#fail(parsed);
      return;
    }
    const receivedAt = performance.now();
    this.#pending = undefined;
    this.#buffer = parsed.rest.length === 0 ? EMPTY : parsed.rest;
    this.lastUsedAt = receivedAt;
    if (parsed.rest.length !== 0) {
      this.#fail(new HttpError('the server sent more than one response'));
    } else if (parsed.close) {
      this.close();
    }
    pending.resolve({ status: parsed.status, head: parsed.head, body: parsed.body, sentAt: pending.sentAt, receivedAt });
  }
}

interface Parsed {
  status: number;
  head: string;
  body: Buffer;
  rest: Buffer;
  close: boolean;
}

/** One complete response at the start of `buffer`, undefined while it is incomplete. */
export function parseResponse(buffer: Buffer): Parsed | Error | undefined {
  const headerEnd = buffer.indexOf(HEADER_END);
  if (headerEnd === -1) return buffer.length > 64 * 1024 ? new HttpError('response header too large') : undefined;
  const text = buffer.toString('latin1', 0, headerEnd);
  const match = /^HTTP\/1\.[01] (\d{3})/.exec(text);
  if (!match) return new HttpError(`not an HTTP/1.1 response: ${JSON.stringify(text.slice(0, 40))}`);
  const status = Number(match[1]);
  const lineEnd = text.indexOf('\r\n');
  const head = lineEnd === -1 ? '' : text.slice(lineEnd + 2);
  const close = /(^|\r\n)connection: *close/i.test(head);
  const bodyStart = headerEnd + 4;

  const length = /(^|\r\n)content-length: *(\d+)/i.exec(head);
  if (length) {
    const end = bodyStart + Number(length[2]);
    if (buffer.length < end) return undefined;
    return { status, head, body: buffer.subarray(bodyStart, end), rest: buffer.subarray(end), close };
  }
  if (/(^|\r\n)transfer-encoding: *chunked/i.test(head)) {
    const chunks: Buffer[] = [];
    let offset = bodyStart;
    for (;;) {
      const sizeEnd = buffer.indexOf(CRLF, offset);
      if (sizeEnd === -1) return undefined;
      const size = Number.parseInt(buffer.toString('latin1', offset, sizeEnd), 16);
      if (!Number.isInteger(size) || size < 0) return new HttpError('malformed chunked body');
      const dataEnd = sizeEnd + 2 + size;
      if (buffer.length < dataEnd + 2) return undefined;
      if (size === 0) {
        // No trailers are expected from the gateway: the last chunk is followed by CRLF.
        return { status, head, body: Buffer.concat(chunks), rest: buffer.subarray(dataEnd + 2), close };
      }
      chunks.push(buffer.subarray(sizeEnd + 2, dataEnd));
      offset = dataEnd + 2;
    }
  }
  if (status === 204 || status === 304 || (status >= 100 && status < 200)) {
    return { status, head, body: EMPTY, rest: buffer.subarray(bodyStart), close };
  }
  return new HttpError(`response ${status} has neither content-length nor chunked encoding`);
}
