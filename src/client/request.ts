// The one private request function every resource calls through, and its arguments: what the
// resources hand the client (client.ts), which signs, times out and retries each call; and the
// checks of the options, which refuse a bad one with a GatewayError before anything is sent.
import { GatewayError } from './errors.ts';

/** The last argument of every call; each field overrides the client's setting for this call. */
export interface RequestOptions {
  /** Milliseconds each attempt may take, at most MAX_WAIT_MS. */
  timeout?: number | undefined;
  maxRetries?: number | undefined;
  /** Aborts the call, including a wait between retries. */
  signal?: AbortSignal | undefined;
}

/** One call to the API, as a resource describes it. */
export interface APIRequest {
  method: 'GET' | 'POST';
  /** From the base URL, beginning with /v1/. */
  path: string;
  /** Sent as JSON. */
  body?: unknown;
}

export type RequestFunction = <T>(request: APIRequest, options?: RequestOptions) => Promise<T>;

/**
 * The longest wait, in milliseconds, for a timeout or a pause (2^31 - 1, about 24.8 days): the
 * longest a timer keeps. Node fires a longer one, or one of NaN, after 1 ms, so such a timeout
 * would end every attempt at once and such a pause would poll in a tight loop.
 */
export const MAX_WAIT_MS = 2_147_483_647;

/** `value`, a number of retries, when it is a whole number, 0 or more. */
export function checkCount(name: string, value: number): number {
  if (!Number.isSafeInteger(value) || value < 0) throw new GatewayError(`${name} must be a whole number, 0 or more.`);
  return value;
}

/** `value`, a timeout or a pause, when it is a whole number of milliseconds from 0 to MAX_WAIT_MS. */
export function checkMilliseconds(name: string, value: number): number {
  if (!Number.isSafeInteger(value) || value < 0 || value > MAX_WAIT_MS) {
    throw new GatewayError(`${name} must be a whole number of milliseconds from 0 to ${MAX_WAIT_MS}.`);
  }
  return value;
}
