// Live mode: POST {base_url}/chat/completions on any OpenAI-compatible provider, through
// undici's request API rather than fetch: thousands of calls stay in flight at once, and fetch
// (undici too) wraps each in WHATWG streams and a Response object, which cost CPU and memory.
import { pipeline, type Transform } from 'node:stream';
import { constants, createBrotliDecompress, createGunzip, createInflate, createZstdDecompress } from 'node:zlib';
import { Agent, request } from 'undici';
import { parseRetryAfter } from '../client/retry.ts';
import { errorCode } from '../network-errors.ts';
import { AnswerMemory, SMALL_ANSWER_BYTES } from './answer-memory.ts';
import type { AttemptOutcome } from './outcome.ts';
import { checkCompletion, failedWithStatus } from './outcome.ts';

// Idle connections kept for the next calls this long (a busy upstream reuses them at once).
const KEEP_ALIVE_MS = 10_000;

export interface UpstreamCall {
  /** JSON text of the request body. */
  body: string;
  /** Aborts the call: the upstream timeout, or the worker shutting down. */
  signal: AbortSignal;
}

export interface OpenAiOptions {
  baseUrl: string;
  apiKey: string | undefined;
}

export interface UpstreamClientOptions {
  /**
   * A 2xx answer larger than this is upstream_invalid_response, read no further
   * (UPSTREAM_MAX_RESPONSE_BYTES): a chat completion is a few kilobytes.
   */
  maxResponseBytes: number;
  /** The memory for answers larger than SMALL_ANSWER_BYTES while they are read, all calls together (UPSTREAM_ANSWER_MEMORY_MB). */
  answerMemoryBytes: number;
}

/** The connections of a worker's calls: as many per upstream as calls in flight, kept alive between them. */
export class UpstreamClient {
  readonly #maxResponseBytes: number;
  /** Large answers being read, and those waiting for memory to be read. */
  readonly answerMemory: AnswerMemory;
  readonly #agent = new Agent({
    connections: null,
    keepAliveTimeout: KEEP_ALIVE_MS,
    // The call's own signal ends it (UPSTREAM_TIMEOUT_MS); LLM answers take minutes at times.
    headersTimeout: 0,
    bodyTimeout: 0,
  });

  constructor(options: UpstreamClientOptions) {
    this.#maxResponseBytes = options.maxResponseBytes;
    this.answerMemory = new AnswerMemory(options.answerMemoryBytes);
  }

  async call(options: OpenAiOptions, call: UpstreamCall): Promise<AttemptOutcome> {
    const headers: Record<string, string> = { 'content-type': 'application/json', accept: 'application/json' };
    if (options.apiKey) headers.authorization = `Bearer ${options.apiKey}`;
    let response: Awaited<ReturnType<typeof request>>;
    try {
      response = await request(`${options.baseUrl}/chat/completions`, {
        method: 'POST',
        headers,
        body: call.body,
        signal: call.signal,
        dispatcher: this.#agent,
      });
    } catch (error) {
      return connectionFailure(error, call.signal);
    }
    const status = response.statusCode;
    if (status < 200 || status >= 300) {
      // Read (up to a limit) and dropped, so that the connection can carry the next call.
      await response.body.dump({ limit: 64 * 1024 }).catch(() => {});
      return failedWithStatus(status, parseRetryAfter(header(response.headers['retry-after'])));
    }
    const length = header(response.headers['content-length']);
    const announced = length === null || !/^\d+$/.test(length) ? undefined : Number(length);
    if (announced !== undefined && announced > this.#maxResponseBytes) {
      // Said so before a byte of it: not read at all (the connection is closed).
      discard(response.body);
      return this.#tooLarge(status);
    }
    const codings = contentCodings(response.headers['content-encoding']);
    if (codings.some((coding) => !DECODERS.has(coding))) {
      discard(response.body);
      return invalidBody(status, "the 2xx body's content-encoding is not one the gateway reads (gzip, deflate, br, zstd)");
    }
    // Codings are undone last applied first. The limits count the decoded bytes, so an answer
    // that inflates past them (a decompression bomb) is stopped there; its content-length, the
    // encoded size, says nothing of the memory it needs.
    const decoders = codings.toReversed().map((coding) => DECODERS.get(coding)!);
    const windows = decoders.reduce((sum, decoder) => sum + decoder.windowBytes, 0);
    // Where a failure began: the connection (the body) or a decoder (each passes it on to the other).
    let failedFirst: 'body' | 'decoder' | undefined;
    response.body.once('error', () => (failedFirst ??= 'body'));
    let release: (() => void) | undefined;
    let streams: Transform[] = [];
    try {
      // A decoder with a large window holds it from its first bytes: its memory, and all the
      // answer may come to, are reserved before it starts (so an answer waiting for them holds none).
      if (windows > 0) release = await this.answerMemory.reserve(this.#maxResponseBytes + windows, call.signal);
      streams = decoders.map((decoder) => decoder.create().once('error', () => (failedFirst ??= 'decoder')));
      if (streams.length > 0) pipeline([response.body, ...streams], () => {});
      const text = await readLimited(streams.at(-1) ?? response.body, {
        maxBytes: this.#maxResponseBytes,
        // Past the small answers' share, memory for all that may still come, at once.
        reserve: async () => {
          if (release) return;
          const needed = streams.length === 0 ? (announced ?? this.#maxResponseBytes) : this.#maxResponseBytes;
          release = await this.answerMemory.reserve(needed, call.signal);
        },
      });
      // checkCompletion never throws: it turns what it cannot parse into an outcome.
      return text === undefined ? this.#tooLarge(status) : checkCompletion(text, status);
    } catch (error) {
      // A body that arrived but does not decode is the answer's fault, not the connection's.
      if (failedFirst === 'decoder' && !call.signal.aborted) {
        return invalidBody(status, `the 2xx body is not valid ${codings.join(', ')}`);
      }
      return connectionFailure(error, call.signal);
    } finally {
      release?.();
      // (A body whose decoders never started, its reservation abandoned, is closed unread.)
      if (streams.length < decoders.length) response.body.destroy();
      for (const stream of streams) stream.destroy();
    }
  }

  #tooLarge(status: number): AttemptOutcome {
    return {
      ok: false,
      code: 'upstream_invalid_response',
      detail: `the 2xx body is larger than ${this.#maxResponseBytes} bytes`,
      upstreamStatus: status,
    };
  }

  /** Closes the connections; calls still in flight are ended. */
  async close(): Promise<void> {
    await this.#agent.destroy();
  }
}

/**
 * The body as text; undefined as soon as it passes `maxBytes`. Once past SMALL_ANSWER_BYTES, it
 * awaits `reserve` before it reads on (the stream, and with it the connection, paused meanwhile).
 */
async function readLimited(
  body: NodeJS.ReadableStream & AsyncIterable<Buffer>,
  options: { maxBytes: number; reserve: () => Promise<void> },
): Promise<string | undefined> {
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of body) {
    if (size <= SMALL_ANSWER_BYTES && size + chunk.byteLength > SMALL_ANSWER_BYTES) await options.reserve();
    size += chunk.byteLength;
    // Leaving the loop ends the stream, and with it the connection.
    if (size > options.maxBytes) return undefined;
    chunks.push(chunk);
  }
  return Buffer.concat(chunks).toString('utf8');
}

interface Decoder {
  create: () => Transform;
  /** The memory its window may take past a call's own costs (gzip's 32 KB is among those). */
  windowBytes: number;
}

const MiB = 1024 * 1024;

/** The content codings an answer may come in, and what undoes each (those undici's fetch undoes). */
const DECODERS: ReadonlyMap<string, Decoder> = new Map([
  ['gzip', { create: () => createGunzip(), windowBytes: 0 }],
  ['x-gzip', { create: () => createGunzip(), windowBytes: 0 }],
  ['deflate', { create: () => createInflate(), windowBytes: 0 }],
  // Brotli's window is up to 16 MiB (without its large-window option, which Node leaves off).
  ['br', { create: () => createBrotliDecompress(), windowBytes: 16 * MiB }],
  // A window of 8 MiB at most (RFC 9659): a frame that asks for more is refused.
  ['zstd', { create: () => createZstdDecompress({ params: { [constants.ZSTD_d_windowLogMax]: 23 } }), windowBytes: 8 * MiB }],
]);

/** The codings content-encoding lists (in one header or several), in the order they were applied, without identity. */
function contentCodings(value: string | string[] | undefined): string[] {
  return [value ?? []]
    .flat()
    .join(',')
    .split(',')
    .map((coding) => coding.trim().toLowerCase())
    .filter((coding) => coding !== '' && coding !== 'identity');
}

const invalidBody = (status: number, detail: string): AttemptOutcome => ({
  ok: false,
  code: 'upstream_invalid_response',
  detail,
  upstreamStatus: status,
});

/**
 * Closes a body left unread. undici's body, destroyed unread, emits an error (RequestAbortedError)
 * once the whole of it had arrived: without a listener, that would be an uncaught exception.
 */
function discard(body: NodeJS.ReadableStream & { destroy(): void }): void {
  body.on('error', () => {});
  body.destroy();
}

const header = (value: string | string[] | undefined) => (Array.isArray(value) ? value[0] : value) ?? null;

// An aborted call is reported as a timeout here; the caller knows whether it was the upstream
// timeout or a shutdown (the signal's reason), and says so.
function connectionFailure(error: unknown, signal: AbortSignal): AttemptOutcome {
  const name = error instanceof Error ? error.name : '';
  if (signal.aborted || name === 'AbortError' || name === 'TimeoutError') {
    return { ok: false, code: 'upstream_timeout', detail: 'no complete answer within the upstream timeout', upstreamStatus: null };
  }
  const code = errorCode(error) ?? (name || 'unknown error');
  return { ok: false, code: 'upstream_connection_error', detail: `connection failed: ${code}`, upstreamStatus: null };
}
