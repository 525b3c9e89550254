// The error model of docs/errors.md, written out for checking answers: which HTTP
// status goes with which type and codes, and what an error body looks like.

export const ERRORS_BY_STATUS: Record<number, { type: string; codes: string[] }> = {
  400: {
    type: 'invalid_request_error',
    codes: ['invalid_json', 'invalid_body', 'missing_parameter', 'invalid_parameter', 'unknown_parameter', 'stream_not_supported'],
  },
  401: {
    type: 'authentication_error',
    codes: ['missing_api_key', 'invalid_api_key', 'missing_signature', 'invalid_signature', 'signature_expired', 'replayed_request'],
  },
  404: { type: 'not_found_error', codes: ['request_not_found', 'route_not_found'] },
  405: { type: 'invalid_request_error', codes: ['method_not_allowed'] },
  413: { type: 'invalid_request_error', codes: ['request_too_large'] },
  415: { type: 'invalid_request_error', codes: ['unsupported_media_type'] },
  422: { type: 'idempotency_error', codes: ['idempotency_key_reused'] },
  429: { type: 'rate_limit_error', codes: ['rate_limit_exceeded'] },
  500: { type: 'api_error', codes: ['internal_error'] },
  503: { type: 'api_error', codes: ['service_unavailable'] },
};

/**
 * What is wrong with an error answer, or undefined when it is exactly the contract's shape:
 * { error: { message, type, code, param } } with the type and code of its status, JSON, and
 * retry-after on 429 and 503.
 */
export function errorShapeProblem(status: number, headers: Headers | undefined, body: unknown): string | undefined {
  const expected = ERRORS_BY_STATUS[status];
  if (!expected) return `HTTP ${status} is not an error status of the contract`;
  const contentType = headers?.get('content-type') ?? '';
  if (!/^application\/json\b/.test(contentType)) return `content-type is ${JSON.stringify(contentType)}, not application/json`;
  if (typeof body !== 'object' || body === null || Array.isArray(body)) return `the body is not a JSON object: ${preview(body)}`;
  const keys = Object.keys(body);
  if (keys.length !== 1 || keys[0] !== 'error') return `the body has keys ${JSON.stringify(keys)}, not just "error"`;
  const error = (body as { error: unknown }).error;
  if (typeof error !== 'object' || error === null || Array.isArray(error)) return `error is not an object: ${preview(error)}`;
  const fields = Object.keys(error).sort();
  if (fields.join(',') !== 'code,message,param,type') return `error has fields ${JSON.stringify(fields)}`;
  const { message, type, code, param } = error as Record<string, unknown>;
  if (typeof message !== 'string' || message === '') return 'error.message is not a non-empty string';
  if (type !== expected.type) return `HTTP ${status} with type ${JSON.stringify(type)}, not ${expected.type}`;
  if (typeof code !== 'string' || !expected.codes.includes(code)) {
    return `HTTP ${status} with code ${JSON.stringify(code)}, not one of ${expected.codes.join(', ')}`;
  }
  if (param !== null && typeof param !== 'string') return `error.param is ${preview(param)}, not a string or null`;
  if ((status === 429 || status === 503) && !headers?.get('retry-after')) return `HTTP ${status} without retry-after`;
  return undefined;
}

export function preview(value: unknown, length = 200): string {
  const text = typeof value === 'string' ? value : JSON.stringify(value);
  return text === undefined ? String(value) : text.length > length ? `${text.slice(0, length)}...` : text;
}
