// The one error model of the API (docs/errors.md). Anything in the code may throw an
// ApiError; the error middleware renders it as { error: { message, type, code, param } }.
// Any other error becomes a 500 internal_error whose details go to the log, never the client.

export type ErrorType =
  | 'invalid_request_error'
  | 'authentication_error'
  | 'not_found_error'
  | 'idempotency_error'
  | 'rate_limit_error'
  | 'api_error';

export interface ErrorBody {
  error: { message: string; type: ErrorType; code: string; param: string | null };
}

export class ApiError extends Error {
  override name = 'ApiError';
  readonly status: number;
  readonly type: ErrorType;
  readonly code: string;
  readonly param: string | null;
  /** Seconds, sent as the retry-after header. */
  readonly retryAfter: number | undefined;

  constructor(
    status: number,
    type: ErrorType,
    code: string,
    message: string,
    options: { param?: string | null; retryAfter?: number } = {},
  ) {
    // A 4xx is an answer to the client, not a fault of ours: it carries no stack, whose capture
    // would cost more than the rest of the answer when a client sends thousands of bad requests.
    const stackTraceLimit = Error.stackTraceLimit;
    if (status < 500) Error.stackTraceLimit = 0;
    super(message);
    Error.stackTraceLimit = stackTraceLimit;
    this.status = status;
    this.type = type;
    this.code = code;
    this.param = options.param ?? null;
    this.retryAfter = options.retryAfter;
  }

  toBody(): ErrorBody {
    return { error: { message: this.message, type: this.type, code: this.code, param: this.param } };
  }
}

export const invalidRequest = (code: string, message: string, param: string | null = null) =>
  new ApiError(400, 'invalid_request_error', code, message, { param });

export const authenticationError = (code: string, message: string) =>
  new ApiError(401, 'authentication_error', code, message);

export const requestNotFound = () =>
  new ApiError(404, 'not_found_error', 'request_not_found', 'No request with that id exists.');

export const routeNotFound = () =>
  new ApiError(404, 'not_found_error', 'route_not_found', 'There is no such route.');

export const methodNotAllowed = () =>
  new ApiError(405, 'invalid_request_error', 'method_not_allowed', 'That method is not allowed on this route.');

export const requestTooLarge = (limit: number) =>
  new ApiError(413, 'invalid_request_error', 'request_too_large', `The body is larger than ${limit} bytes.`);

export const unsupportedMediaType = () =>
  new ApiError(
    415,
    'invalid_request_error',
    'unsupported_media_type',
    'The body must be sent with Content-Type: application/json.',
  );

export const requestAlreadyFinished = (status: string) =>
  new ApiError(409, 'invalid_request_error', 'request_already_finished', `The request has already ${status === 'completed' ? 'completed' : 'failed'}: there is nothing to cancel.`);

export const idempotencyKeyReused = () =>
  new ApiError(
    422,
    'idempotency_error',
    'idempotency_key_reused',
    'This idempotency_key was already used with a different body.',
    { param: 'idempotency_key' },
  );

/** An intake limit (docs/lanes.md, "Intake limits") refuses the request; `message` says which. */
export const rateLimitExceeded = (retryAfterSeconds: number, message: string) =>
  new ApiError(429, 'rate_limit_error', 'rate_limit_exceeded', message, { retryAfter: retryAfterSeconds });

export const internalError = () =>
  new ApiError(500, 'api_error', 'internal_error', 'The server failed to handle the request.');

export const serviceUnavailable = (
  retryAfter = 1,
  message = 'The service is temporarily unavailable; try again.',
) => new ApiError(503, 'api_error', 'service_unavailable', message, { retryAfter });
