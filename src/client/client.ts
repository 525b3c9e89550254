// The Gateway client: a small tree of resources over one private request function, which
// signs every attempt, times it out, and retries what is worth retrying.
import {
  APIConnectionError,
  APIConnectionTimeoutError,
  APIError,
  APIUserAbortError,
  GatewayError,
} from './errors.ts';
import { checkCount, checkMilliseconds, type APIRequest, type RequestFunction, type RequestOptions } from './request.ts';
import { Chat } from './resources/chat.ts';
import { Requests } from './resources/requests.ts';
import { Webhooks } from './resources/webhooks.ts';
import { backoffMs, isRetryableAnswer, MAX_RETRY_AFTER_MS, retryAfterMs, sleep } from './retry.ts';
import { normalizeBaseURL, pathRelativeTo, SIGNATURE_HEADER, signRequest, urlUnder } from './signing.ts';

export type Fetch = (input: string | URL | Request, init?: RequestInit) => Promise<Response>;

export interface GatewayOptions {
  /** `svc_live_...` or `svc_test_...`. */
  apiKey: string;
  /** `svc_sig_...`, shown once with the key. */
  signingSecret: string;
  /** Default `http://localhost:8080`. A trailing `/v1` is ignored. */
  baseURL?: string | undefined;
  /** Default: the global fetch. */
  fetch?: Fetch | undefined;
  /** Retries after the first attempt of each call. Default 2. */
  maxRetries?: number | undefined;
  /** Milliseconds each attempt may take, answer body included, at most 2^31 - 1. Default 2 minutes. */
  timeout?: number | undefined;
}

export const DEFAULT_BASE_URL = 'http://localhost:8080';
/** Comfortably above the server's default wait (WAIT_TIMEOUT_MS, 30 s), so wait=true answers arrive. */
export const DEFAULT_TIMEOUT_MS = 120_000;
export const DEFAULT_MAX_RETRIES = 2;

export class Gateway {
  readonly chat: Chat;
  readonly requests: Requests;
  readonly webhooks: Webhooks;

  /** The base URL in use, normalized. */
  readonly baseURL: string;
  readonly maxRetries: number;
  readonly timeout: number;

  readonly #apiKey: string;
  readonly #signingSecret: string;
  readonly #base: URL;
  readonly #fetch: Fetch;

  constructor(options: GatewayOptions) {
    if (!options.apiKey) throw new GatewayError('An apiKey is required (svc_live_... or svc_test_...).');
    if (!options.signingSecret) throw new GatewayError('A signingSecret is required (svc_sig_..., shown with the key).');
    // fetch refuses such a header on every attempt, with an error that quotes it (and whatever
    // was pasted with the key): refused here, once, without showing it. fetch trims the tabs,
    // spaces and line breaks around a header value, so those are no fault.
    if (/[\0\r\n\u0100-\uffff]/.test(options.apiKey.replace(/^[\t\n\r ]+|[\t\n\r ]+$/g, ''))) {
      throw new GatewayError(
        'The apiKey cannot be sent in a header: it holds a line break, a NUL or a character beyond Latin-1. ' +
          'It is svc_live_ or svc_test_ followed by letters and digits, on one line.',
      );
    }
    this.#apiKey = options.apiKey;
    this.#signingSecret = options.signingSecret;
    this.#base = normalizeBaseURL(options.baseURL ?? DEFAULT_BASE_URL);
    this.baseURL = this.#base.href.replace(/\/$/, '');
    this.#fetch = options.fetch ?? ((input, init) => globalThis.fetch(input, init));
    this.maxRetries = checkCount('maxRetries', options.maxRetries ?? DEFAULT_MAX_RETRIES);
    this.timeout = checkMilliseconds('timeout', options.timeout ?? DEFAULT_TIMEOUT_MS);

    const request: RequestFunction = (apiRequest, requestOptions) => this.#request(apiRequest, requestOptions);
    this.chat = new Chat(request);
    this.requests = new Requests(request);
    this.webhooks = new Webhooks();
  }

  async #request<T>(request: APIRequest, options: RequestOptions = {}): Promise<T> {
    const maxRetries = checkCount('maxRetries', options.maxRetries ?? this.maxRetries);
    const timeout = checkMilliseconds('timeout', options.timeout ?? this.timeout);
    const url = urlUnder(this.#base, request.path);
    // Serialized once: every attempt sends, and signs, the very same bytes.
    const body = request.body === undefined ? undefined : JSON.stringify(request.body);

    for (let failures = 0; ; failures++) {
      let failure: APIError;
      let waitMs: number | undefined;
      try {
        const { response, text } = await this.#attempt(request.method, url, body, timeout, options.signal);
        if (response.ok) return parseSuccess<T>(response, text);
        failure = APIError.generate(response.status, parseJson(text), text.slice(0, 500) || undefined, response.headers);
        if (!isRetryableAnswer(response.status, failure.code)) throw failure;
        waitMs = retryAfterMs(response.headers);
      } catch (error) {
        // Connection failures and timeouts are retried; an abort or a final answer is not.
        if (!(error instanceof APIConnectionError)) throw error;
        failure = error;
      }
      if (failures >= maxRetries || (waitMs !== undefined && waitMs > MAX_RETRY_AFTER_MS)) throw failure;
      await sleep(waitMs ?? backoffMs(failures + 1), options.signal);
    }
  }

  /** One signed attempt: a fresh timestamp and nonce, the answer read whole within `timeout`. */
  async #attempt(
    method: APIRequest['method'],
    url: URL,
    body: string | undefined,
    timeout: number,
    callerSignal: AbortSignal | undefined,
  ): Promise<{ response: Response; text: string }> {
    if (callerSignal?.aborted) throw new APIUserAbortError({ cause: callerSignal.reason });
    const signature = await signRequest({
      signingSecret: this.#signingSecret,
      method,
      path: pathRelativeTo(url, this.#base),
      body,
    });
    const headers: Record<string, string> = {
      Accept: 'application/json',
      Authorization: `Bearer ${this.#apiKey}`,
      [SIGNATURE_HEADER]: signature.header,
    };
    if (body !== undefined) headers['Content-Type'] = 'application/json';

    const timer = new AbortController();
    const timeoutId = setTimeout(() => timer.abort(), timeout);
    const signal = callerSignal ? AbortSignal.any([callerSignal, timer.signal]) : timer.signal;
    try {
      const init: RequestInit = { method, headers, signal };
      if (body !== undefined) init.body = body;
      // Raced against the signal too, so a fetch that ignores its signal cannot outlive the timeout.
      const response = await untilAborted(this.#fetch.call(undefined, url.href, init), signal);
      const text = await untilAborted(response.text(), signal);
      return { response, text };
    } catch (error) {
      if (callerSignal?.aborted) throw new APIUserAbortError({ cause: callerSignal.reason });
      if (timer.signal.aborted) throw new APIConnectionTimeoutError({ message: `Request timed out after ${timeout} ms.` });
      throw new APIConnectionError({ cause: error });
    } finally {
      clearTimeout(timeoutId);
    }
  }
}

function parseSuccess<T>(response: Response, text: string): T {
  const parsed = parseJson(text);
  if (parsed === undefined) {
    throw new APIError(response.status, undefined, `The answer is not JSON: ${text.slice(0, 200)}`, response.headers);
  }
  return parsed as T;
}

function parseJson(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return undefined;
  }
}

function untilAborted<T>(promise: Promise<T>, signal: AbortSignal): Promise<T> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) return reject(signal.reason);
    const onAbort = () => reject(signal.reason);
    signal.addEventListener('abort', onAbort, { once: true });
    promise.then(
      (value) => {
        signal.removeEventListener('abort', onAbort);
        resolve(value);
      },
      (error: unknown) => {
        signal.removeEventListener('abort', onAbort);
        reject(error);
      },
    );
  });
}
