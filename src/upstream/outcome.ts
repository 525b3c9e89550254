// How an attempt ends: a chat completion, or one of these codes, each with whose fault it is.
// - request: the request's own (the upstream refused it as it is): always charged, never retried.
// - upstream: the provider's (down, slow, broken, or refusing the operator's key): retried, and
//   charged to the request only while its lane is otherwise healthy (a request failing where
//   others succeed); these failures are what open a lane.
// - rate_limited: a 429 pauses the lane; never charged.
// - worker: the worker running the attempt was lost; charged, so that a request that brings
//   workers down still ends.
// - shutdown: the worker was stopped (SIGTERM, SIGINT) with the call under way past its grace,
//   also worker_lost; never charged: an operator's restart is not the request's doing.

/** Whose fault a failed attempt is. */
export type Fault = 'request' | 'upstream' | 'rate_limited' | 'worker' | 'shutdown';

/**
 * The one code no call returns: the worker's deadline expiry writes it (worker/deadlines.ts), on
 * the request and on the attempt it cuts short. Not retried.
 */
export const DEADLINE_EXCEEDED = 'deadline_exceeded';

export const ATTEMPT_ERRORS = {
  upstream_timeout: { retryable: true, fault: 'upstream' },
  upstream_connection_error: { retryable: true, fault: 'upstream' },
  upstream_rate_limited: { retryable: true, fault: 'rate_limited' },
  upstream_server_error: { retryable: true, fault: 'upstream' },
  upstream_invalid_response: { retryable: true, fault: 'upstream' },
  upstream_auth_error: { retryable: true, fault: 'upstream' },
  worker_lost: { retryable: true, fault: 'worker' },
  upstream_bad_request: { retryable: false, fault: 'request' },
} as const satisfies Record<string, { retryable: boolean; fault: Fault }>;

export type AttemptErrorCode = keyof typeof ATTEMPT_ERRORS;

/** The token counts of a completion's `usage`, where it has them. */
export interface Usage {
  prompt: number | null;
  completion: number | null;
  total: number | null;
}

export type AttemptOutcome =
  | { ok: true; result: string; upstreamStatus: number; usage: Usage }
  | {
      ok: false;
      code: AttemptErrorCode;
      /** Our own words for operators; never text taken from the upstream's answer. */
      detail: string;
      upstreamStatus: number | null;
      /** The upstream's retry-after, in milliseconds, when it sent one. */
      retryAfterMs?: number;
    };

/**
 * The error code for a non-2xx upstream HTTP status. A status past 599, which HTTP does not have
 * (undici passes on any three digits), is an invalid answer, as a 1xx or 3xx is.
 */
export function codeForStatus(status: number): AttemptErrorCode {
  if (status === 429) return 'upstream_rate_limited';
  if (status === 401 || status === 403) return 'upstream_auth_error';
  if (status === 408 || status === 409 || (status >= 500 && status <= 599)) return 'upstream_server_error';
  if (status >= 400 && status <= 499) return 'upstream_bad_request';
  return 'upstream_invalid_response';
}

export function failedWithStatus(status: number, retryAfterMs?: number): AttemptOutcome {
  return {
    ok: false,
    code: codeForStatus(status),
    detail: `upstream answered HTTP ${status}`,
    upstreamStatus: status,
    ...(retryAfterMs === undefined ? {} : { retryAfterMs }),
  };
}

/** A 2xx body must be a JSON chat completion object to count as a result. */
export function checkCompletion(text: string, status: number): AttemptOutcome {
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch {
    return invalid(status, 'the 2xx body is not JSON');
  }
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    return invalid(status, 'the 2xx body is not a JSON object');
  }
  const completion = value as Record<string, unknown>;
  if (completion.object !== 'chat.completion') return invalid(status, 'the 2xx body is not a chat.completion object');
  if (typeof completion.id !== 'string') return invalid(status, 'the chat completion has no string id');
  if (!Array.isArray(completion.choices)) return invalid(status, 'the chat completion has no choices array');
  return { ok: true, result: text, upstreamStatus: status, usage: usageOf(completion.usage) };
}

// The most tokens a count of `usage` may say: the requests' token columns are integer (int4).
const MAX_TOKENS = 2_147_483_647;

/** `usage`'s counts, each null where it is missing or does not fit its column (the sum too). */
function usageOf(value: unknown): Usage {
  const usage = typeof value === 'object' && value !== null ? (value as Record<string, unknown>) : {};
  const fitting = (n: unknown) => (typeof n === 'number' && Number.isSafeInteger(n) && n >= 0 && n <= MAX_TOKENS ? n : null);
  const prompt = fitting(usage.prompt_tokens);
  const completion = fitting(usage.completion_tokens);
  const total = fitting(usage.total_tokens) ?? (prompt !== null && completion !== null ? fitting(prompt + completion) : null);
  return { prompt, completion, total };
}

const invalid = (status: number, detail: string): AttemptOutcome => ({
  ok: false,
  code: 'upstream_invalid_response',
  detail,
  upstreamStatus: status,
});
