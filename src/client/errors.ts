// What a failed call throws. Every error of the library is a GatewayError; an answer from the
// server that is not a success is an APIError of the class its status chooses (APIError.generate),
// carrying the contract's { message, type, code, param } and the response headers. A webhook
// delivery that does not verify is a WebhookVerificationError: no call was made, so no APIError.
import type { ErrorObject } from './types.ts';

export class GatewayError extends Error {
  override name = 'GatewayError';
}

export class APIError extends GatewayError {
  override name = 'APIError';
  /** The HTTP status; undefined when no answer came (connection, timeout, abort). */
  readonly status: number | undefined;
  readonly headers: Headers | undefined;
  /** The `error` object of the body, when the body had one. */
  readonly error: ErrorObject | undefined;
  /** Stable, e.g. `invalid_request_error`; null when the answer had no contract error body. */
  readonly type: string | null;
  /** Stable, e.g. `invalid_parameter`; null when the answer had no contract error body. */
  readonly code: string | null;
  /** The body field at fault, e.g. `messages[0].role`; null otherwise. */
  readonly param: string | null;

  constructor(
    status: number | undefined,
    error: ErrorObject | undefined,
    message: string | undefined,
    headers: Headers | undefined,
    options?: { cause?: unknown },
  ) {
    super(composeMessage(status, error, message), options);
    this.status = status;
    this.headers = headers;
    this.error = error;
    this.type = error?.type || null;
    this.code = error?.code || null;
    this.param = error?.param || null;
  }

  /** The one place an HTTP answer becomes an error class. `body` is the parsed JSON body, if any. */
  static generate(status: number, body: unknown, message: string | undefined, headers: Headers): APIError {
    const error = errorObjectOf(body);
    const make = (Class: typeof APIError) => new Class(status, error, message, headers);
    if (status === 400) return make(BadRequestError);
    if (status === 401) return make(AuthenticationError);
    if (status === 403) return make(PermissionDeniedError);
    if (status === 404) return make(NotFoundError);
    if (status === 409) return make(ConflictError);
    if (status === 422) return make(UnprocessableEntityError);
    if (status === 429) return make(RateLimitError);
    if (status >= 500) return make(InternalServerError);
    return make(APIError);
  }
}

/** 400: the body broke a rule (`param` names the field). */
export class BadRequestError extends APIError {
  override name = 'BadRequestError';
}

/** 401: missing or invalid key, or a missing, invalid, expired or replayed signature. */
export class AuthenticationError extends APIError {
  override name = 'AuthenticationError';
}

export class PermissionDeniedError extends APIError {
  override name = 'PermissionDeniedError';
}

/** 404: no such request for this key's project and mode, or no such route. */
export class NotFoundError extends APIError {
  override name = 'NotFoundError';
}

/** 409: e.g. `request_already_finished`, cancelling a request that is completed or failed. */
export class ConflictError extends APIError {
  override name = 'ConflictError';
}

/** 422: the idempotency_key was already used with a different body. */
export class UnprocessableEntityError extends APIError {
  override name = 'UnprocessableEntityError';
}

export class RateLimitError extends APIError {
  override name = 'RateLimitError';
}

/** 5xx. */
export class InternalServerError extends APIError {
  override name = 'InternalServerError';
}

/** No answer: the connection failed or dropped. `cause` holds what fetch threw. */
export class APIConnectionError extends APIError {
  override name = 'APIConnectionError';
  constructor(options: { message?: string; cause?: unknown } = {}) {
    super(undefined, undefined, options.message ?? 'Connection error.', undefined, { cause: options.cause });
  }
}

/** No complete answer within the timeout. */
export class APIConnectionTimeoutError extends APIConnectionError {
  override name = 'APIConnectionTimeoutError';
  constructor(options: { message?: string } = {}) {
    super({ message: options.message ?? 'Request timed out.' });
  }
}

/** The caller's AbortSignal fired. `cause` holds the signal's reason. */
export class APIUserAbortError extends APIError {
  override name = 'APIUserAbortError';
  constructor(options: { message?: string; cause?: unknown } = {}) {
    super(undefined, undefined, options.message ?? 'Request was aborted.', undefined, { cause: options.cause });
  }
}

/**
 * Why `webhooks.unwrap` refused a delivery:
 * - `missing_header`: webhook-id, webhook-timestamp or webhook-signature is absent or empty;
 * - `invalid_header`: webhook-timestamp is not a whole number of seconds;
 * - `invalid_signature`: no v1 signature in webhook-signature matches the body under the secret;
 * - `timestamp_too_old`: webhook-timestamp is more than 300 s in the past (perhaps a replay);
 * - `timestamp_in_future`: webhook-timestamp is more than 300 s ahead (a clock is wrong);
 * - `invalid_body`: validly signed, but not a JSON event `{ type, timestamp, data }`.
 */
export type WebhookVerificationErrorCode =
  | 'missing_header'
  | 'invalid_header'
  | 'invalid_signature'
  | 'timestamp_too_old'
  | 'timestamp_in_future'
  | 'invalid_body';

/** A webhook delivery that does not verify: answer it with a 4xx and do not act on it. */
export class WebhookVerificationError extends GatewayError {
  override name = 'WebhookVerificationError';
  readonly code: WebhookVerificationErrorCode;

  constructor(code: WebhookVerificationErrorCode, message: string) {
    super(message);
    this.code = code;
  }
}

function errorObjectOf(body: unknown): ErrorObject | undefined {
  const error = (body as { error?: unknown } | null | undefined)?.error;
  if (typeof error !== 'object' || error === null) return undefined;
  const field = (name: string) => {
    const value = (error as Record<string, unknown>)[name];
    return typeof value === 'string' ? value : null;
  };
  return { message: field('message') ?? '', type: field('type') ?? '', code: field('code') ?? '', param: field('param') };
}

function composeMessage(status: number | undefined, error: ErrorObject | undefined, message: string | undefined): string {
  const text = error?.message || message;
  if (status !== undefined && text) return `${status} ${text}`;
  if (status !== undefined) return `${status} status code (no body)`;
  return text || '(no status code or body)';
}
