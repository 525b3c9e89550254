// Live mode: POST {base_url}/chat/completions on any OpenAI-compatible provider, through
// undici's request API rather than fetch: thousands of calls stay in flight at once, and fetch
// (undici too) wraps each in WHATWG streams and a Response object, which cost CPU and memory.
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
      response.body.destroy();
      return this.#tooLarge(status);
    }
    let release: (() => void) | undefined;
    try {
      const text = await readLimited(response.body, {
        maxBytes: this.#maxResponseBytes,
        // Past the small answers' share, memory for all that may still come, at once.
        reserve: async () => {
          release = await this.answerMemory.reserve(announced ?? this.#maxResponseBytes, call.signal);
        },
      });
      // checkCompletion never throws: it turns what it cannot parse into an outcome.
      return text === undefined ? this.#tooLarge(status) : checkCompletion(text, status);
    } catch (error) {
      return connectionFailure(error, call.signal);
    } finally {
      release?.();
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
