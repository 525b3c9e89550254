// Live mode: POST {UPSTREAM_BASE_URL}/chat/completions on any OpenAI-compatible provider.
import type { AttemptOutcome } from './outcome.ts';
import { checkCompletion, failedWithStatus } from './outcome.ts';

// A chat completion is a few kilobytes; anything this large is not one.
const MAX_RESPONSE_BYTES = 16 * 1024 * 1024;

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

export async function callOpenAiCompatible(options: OpenAiOptions, call: UpstreamCall): Promise<AttemptOutcome> {
  const headers: Record<string, string> = { 'content-type': 'application/json', accept: 'application/json' };
  if (options.apiKey) headers.authorization = `Bearer ${options.apiKey}`;
  let response: Response;
  try {
    response = await fetch(`${options.baseUrl}/chat/completions`, {
      method: 'POST',
      headers,
      body: call.body,
      signal: call.signal,
      redirect: 'manual',
    });
  } catch (error) {
    return connectionFailure(error, call.signal);
  }
  if (response.status < 200 || response.status >= 300) {
    await response.body?.cancel().catch(() => {});
    return failedWithStatus(response.status, parseRetryAfter(response.headers.get('retry-after')));
  }
  let text: string;
  try {
    const read = await readLimited(response);
    if (read === undefined) {
      return {
        ok: false,
        code: 'upstream_invalid_response',
        detail: `the 2xx body is larger than ${MAX_RESPONSE_BYTES} bytes`,
        upstreamStatus: response.status,
      };
    }
    text = read;
  } catch (error) {
    return connectionFailure(error, call.signal);
  }
  return checkCompletion(text, response.status);
}

async function readLimited(response: Response): Promise<string | undefined> {
  if (!response.body) return '';
  const chunks: Uint8Array[] = [];
  let size = 0;
  for await (const chunk of response.body) {
    size += chunk.byteLength;
    if (size > MAX_RESPONSE_BYTES) {
      await response.body.cancel().catch(() => {});
      return undefined;
    }
    chunks.push(chunk);
  }
  return Buffer.concat(chunks).toString('utf8');
}

// An aborted call is reported as a timeout here; the caller knows whether it was the upstream
// timeout or a shutdown (the signal's reason), and says so.
function connectionFailure(error: unknown, signal: AbortSignal): AttemptOutcome {
  const name = error instanceof Error ? error.name : '';
  if (signal.aborted || name === 'AbortError' || name === 'TimeoutError') {
    return { ok: false, code: 'upstream_timeout', detail: 'no complete answer within the upstream timeout', upstreamStatus: null };
  }
  const cause = error instanceof Error ? (error.cause as { code?: unknown } | undefined) : undefined;
  const code = typeof cause?.code === 'string' ? cause.code : name || 'unknown error';
  return { ok: false, code: 'upstream_connection_error', detail: `connection failed: ${code}`, upstreamStatus: null };
}

/** retry-after in seconds or as an HTTP date, in milliseconds. */
export function parseRetryAfter(value: string | null): number | undefined {
  if (value === null || value.trim() === '') return undefined;
  const seconds = Number(value);
  if (Number.isFinite(seconds)) return seconds >= 0 ? Math.round(seconds * 1000) : undefined;
  const date = Date.parse(value);
  return Number.isNaN(date) ? undefined : Math.max(0, date - Date.now());
}
