// A real OpenAI-compatible server on loopback, scripted by the test: each call to
// POST /v1/chat/completions is answered by `reply`, decided when the call arrives (so a call that
// arrived while replies hang keeps hanging after the script changes, as a real one would). A reply
// may come after a delay, hang, drop the socket, or send the headers and the start of a body and
// hold the rest. The server can also refuse connections for a while (its port closed), and
// enforce limits of its own as providers do: a token bucket of requests_per_minute (one second's
// worth of calls, refilled continuously) and at most max_concurrent calls at once, answering 429
// with retry-after beyond either; a call can be made to reach the limits late (`lateMs`), as one
// held up on its way does. Every call is recorded, with when it arrived and ended and the status
// it was answered.
import http from 'node:http';
import { setTimeout as sleep } from 'node:timers/promises';
import { listenOnLoopback } from './ports.ts';
import type { Teardown } from './teardown.ts';

export interface ReceivedCall {
  /** 1 for the first call, 2 for the second, ... */
  count: number;
  headers: http.IncomingHttpHeaders;
  body: any;
  /** The last message's content, as sent. */
  content: string;
  /** Date.now() when its body had arrived. */
  arrivedAt: number;
  /** Date.now() when it was answered or its connection closed (a call left hanging: when its client gave up). */
  endedAt?: number;
  /** The status sent; undefined while hanging, or when its connection was dropped unanswered. */
  status?: number;
}

export type Reply =
  | {
      status: number;
      json?: unknown;
      text?: string;
      headers?: Record<string, string>;
      /** Answered after this long, unless its client has gone by then. */
      delayMs?: number;
      /**
       * The headers and the body sent, and the body never ended (its content-length, if given,
       * never reached): 'hold' keeps the connection open, 'reset' drops it a moment later.
       */
      partial?: 'hold' | 'reset';
    }
  | { hang: true }
  | { reset: true };

/** How the upstream answers each call: the test's script. */
export type Script = (call: ReceivedCall) => Reply | Promise<Reply>;

export interface Limits {
  requestsPerMinute?: number;
  maxConcurrent?: number;
}

export interface FakeUpstream {
  /** The upstream's base URL (…/v1), the same across refusals. */
  baseUrl: string;
  calls: ReceivedCall[];
  /** Answers the calls that arrive from now on with `reply` instead. */
  replyWith(reply: Script): void;
  /** Closes the port, dropping every connection: connections are refused until `acceptConnections`. */
  refuseConnections(): Promise<void>;
  /** Listens again, on the same port (nothing to do when it is listening). */
  acceptConnections(): Promise<void>;
  /** The most calls under way at once so far (calls refused by the limits are not counted). */
  peakInFlight(): number;
  /** Calls answered 429 by the limits so far, and which limit. */
  refused: { rate: number; concurrency: number };
}

export async function startFakeUpstream(
  t: Teardown,
  reply: Script = completionAfter(0),
  options: {
    limits?: Limits;
    /** How long after it arrived the limits see a call (decided when it arrives): 0 when not given. */
    lateMs?: (call: ReceivedCall) => number;
  } = {},
): Promise<FakeUpstream> {
  const calls: ReceivedCall[] = [];
  const refused = { rate: 0, concurrency: 0 };
  const overLimit = limiter(options.limits ?? {});
  let inFlight = 0;
  let peak = 0;

  const server = http.createServer(async (request, response) => {
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    if (request.method !== 'POST' || request.url !== '/v1/chat/completions') {
      response.writeHead(404).end();
      return;
    }
    const body = JSON.parse(Buffer.concat(chunks).toString('utf8'));
    const call: ReceivedCall = {
      count: calls.length + 1,
      headers: request.headers,
      body,
      content: body.messages?.at(-1)?.content ?? '',
      arrivedAt: Date.now(),
    };
    calls.push(call);
    const late = options.lateMs?.(call) ?? 0;
    if (late > 0) await sleep(late);
    const limit = overLimit(performance.now(), inFlight);
    if (limit) refused[limit.by]++;
    else {
      inFlight++;
      peak = Math.max(peak, inFlight);
    }
    response.once('close', () => {
      if (!limit) inFlight--;
      call.endedAt ??= Date.now();
    });

    const answer = limit ? rateLimited(limit.retryAfterSeconds) : await reply(call);
    if ('hang' in answer) return; // never answered: the gateway's upstream timeout (or its death) ends the call
    if ('reset' in answer) {
      request.socket.destroy();
      return;
    }
    if (answer.delayMs) await sleep(answer.delayMs);
    if (response.destroyed) return;
    call.status = answer.status;
    response.writeHead(answer.status, { 'content-type': 'application/json', ...answer.headers });
    const text = answer.text ?? JSON.stringify(answer.json ?? {});
    if (answer.partial === undefined) {
      response.end(text);
      call.endedAt = Date.now();
      return;
    }
    response.write(text);
    if (answer.partial === 'reset') setTimeout(() => request.socket.destroy(), 5);
  });
  // Calls end when the test or the gateway says, not by this server's own timeouts: a kept-alive
  // connection this server closed just as a call was sent on it would be a failure it never
  // answered, and a hanging call must hang until the gateway gives up.
  server.requestTimeout = 0;
  server.headersTimeout = 0;
  server.keepAliveTimeout = 120_000;

  const port = await listenOnLoopback(t, server);
  return {
    baseUrl: `http://127.0.0.1:${port}/v1`,
    calls,
    replyWith(next) {
      reply = next;
    },
    refuseConnections: () =>
      new Promise<void>((resolve) => {
        if (!server.listening) return resolve();
        server.close(() => resolve());
        server.closeAllConnections();
      }),
    acceptConnections: () =>
      new Promise<void>((resolve, reject) => {
        if (server.listening) return resolve();
        server.once('error', reject);
        server.listen(port, '127.0.0.1', () => {
          server.off('error', reject);
          resolve();
        });
      }),
    peakInFlight: () => peak,
    refused,
  };
}

/**
 * A check of a call arriving at `now` (performance.now()) with `inFlight` calls under way against
 * the limits; it takes a token from the bucket when the rate allows the call.
 */
function limiter({ requestsPerMinute, maxConcurrent }: Limits) {
  const rate = requestsPerMinute === undefined ? undefined : requestsPerMinute / 60_000; // per ms
  const capacity = rate === undefined ? 0 : Math.max(1, rate * 1000);
  let level = capacity;
  let refilledAt = performance.now();
  return (now: number, inFlight: number): { by: 'rate' | 'concurrency'; retryAfterSeconds: number } | undefined => {
    if (rate !== undefined) {
      level = Math.min(capacity, level + (now - refilledAt) * rate);
      refilledAt = now;
      if (level < 1) return { by: 'rate', retryAfterSeconds: Math.max(1, Math.ceil((1 - level) / rate / 1000)) };
      level -= 1;
    }
    if (maxConcurrent !== undefined && inFlight >= maxConcurrent) return { by: 'concurrency', retryAfterSeconds: 1 };
    return undefined;
  };
}

/** An upstream whose calls are all answered (200) once the test says so. */
export async function heldUpstream(t: Teardown) {
  let release!: () => void;
  const released = new Promise<void>((resolve) => (release = resolve));
  const upstream = await startFakeUpstream(t, async (call) => {
    await released;
    return { status: 200, json: completionFor(call.body) };
  });
  return { ...upstream, release };
}

/** The script of a healthy provider: each call answered with a completion after `delayMs`. */
export function completionAfter(delayMs: number): Script {
  return (call) => ({ status: 200, json: completionFor(call.body), delayMs });
}

/** A 429 with retry-after, as a provider's rate limit answers. */
export function rateLimited(retryAfterSeconds: number): Reply {
  return {
    status: 429,
    json: { error: { message: 'Rate limit reached', type: 'requests', code: 'rate_limit_exceeded' } },
    headers: { 'retry-after': String(retryAfterSeconds) },
  };
}

/** A well-formed chat completion answering the last message. */
export function completionFor(body: { model?: string; messages?: { content: string }[] }) {
  return {
    id: `chatcmpl-fake${Math.random().toString(36).slice(2)}`,
    object: 'chat.completion',
    created: Math.floor(Date.now() / 1000),
    model: body.model ?? 'fake',
    choices: [
      {
        index: 0,
        message: { role: 'assistant', content: `echo: ${body.messages?.at(-1)?.content ?? ''}` },
        finish_reason: 'stop',
      },
    ],
    usage: { prompt_tokens: 3, completion_tokens: 3, total_tokens: 6 },
  };
}

/** An OpenAI-style error body for a status, as providers send with 401 and 5xx answers. */
export function errorFor(status: number) {
  return {
    error: {
      message: status === 401 ? 'Incorrect API key provided.' : `The server had an error (HTTP ${status}).`,
      type: status === 401 ? 'invalid_request_error' : 'server_error',
      code: status === 401 ? 'invalid_api_key' : null,
    },
  };
}
