// A fetch that signs, so that clients built for the OpenAI API (the official `openai` SDK's
// `fetch` option) can talk to the gateway:
//
//   const openai = new OpenAI({
//     apiKey: process.env.GATEWAY_API_KEY,
//     baseURL: 'http://localhost:8080/v1',
//     fetch: createSigningFetch({ signingSecret: process.env.GATEWAY_SIGNING_SECRET }),
//   });
//
// It signs what is about to be sent (method, path and query, the exact body bytes) on every
// call, so each of the SDK's own retries carries a signature of its own. The SDK sends the key.
import type { Fetch } from './client.ts';
import { normalizeBaseURL, pathRelativeTo, SIGNATURE_HEADER, signRequest } from './signing.ts';

export interface SigningFetchOptions {
  /** `svc_sig_...`. */
  signingSecret: string;
  /**
   * The gateway's base URL, when it is served under a path prefix (`https://host/gateway`); a
   * trailing `/v1` is ignored, so the SDK's own baseURL will do. Default: the root of each
   * request's origin. A request outside the base URL is refused rather than sent unsigned.
   */
  baseURL?: string | undefined;
  /** The fetch that sends the signed request. Default: the global fetch. */
  fetch?: Fetch | undefined;
}

export function createSigningFetch(options: SigningFetchOptions): Fetch {
  if (!options.signingSecret) throw new TypeError('A signingSecret is required (svc_sig_..., shown with the key).');
  const { signingSecret } = options;
  const base = options.baseURL === undefined ? undefined : normalizeBaseURL(options.baseURL);
  const send: Fetch = options.fetch ?? ((input, init) => globalThis.fetch(input, init));

  return async function signingFetch(input, init) {
    // A Request settles what would be sent: the method, the URL as serialized, and a body of any
    // kind (string, bytes, form data, stream) as bytes, with the content type that goes with it.
    const request = new Request(input, init);
    const body = request.body === null ? undefined : new Uint8Array(await request.arrayBuffer());
    const url = new URL(request.url);
    const signature = await signRequest({
      signingSecret,
      method: request.method,
      path: pathRelativeTo(url, base ?? new URL(url.origin)),
      body,
    });
    const headers = new Headers(request.headers);
    headers.set(SIGNATURE_HEADER, signature.header);

    // Other fetch options (such as an undici dispatcher) pass through; the body now is bytes.
    const { duplex: _duplex, ...rest } = (init ?? {}) as RequestInit & { duplex?: unknown };
    const signed: RequestInit = { ...rest, method: request.method, headers, signal: request.signal };
    if (body !== undefined) signed.body = body;
    return send.call(undefined, request.url, signed);
  };
}
