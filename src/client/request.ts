// The one private request function every resource calls through, and its arguments: what the
// resources hand the client (client.ts), which signs, times out and retries each call.

/** The last argument of every call; each field overrides the client's setting for this call. */
export interface RequestOptions {
  /** Milliseconds each attempt may take. */
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
