// chat-gateway/client: the zero-dependency client of the gateway (CONTRACT.md section 8).
//
//   const client = new Gateway({ apiKey, signingSecret, baseURL });
//   const res = await client.chat.completions.create({ model, messages, wait: true });
//   if (res.object === 'chat.completion.async') {
//     const record = await client.requests.poll(res.id);
//   }
export {
  Gateway,
  Gateway as default,
  DEFAULT_BASE_URL,
  DEFAULT_MAX_RETRIES,
  DEFAULT_TIMEOUT_MS,
  type Fetch,
  type GatewayOptions,
  type RequestOptions,
} from './client.ts';
export { Chat, Completions } from './resources/chat.ts';
export { Requests, type PollOptions } from './resources/requests.ts';
export {
  GatewayError,
  APIError,
  BadRequestError,
  AuthenticationError,
  PermissionDeniedError,
  NotFoundError,
  ConflictError,
  UnprocessableEntityError,
  RateLimitError,
  InternalServerError,
  APIConnectionError,
  APIConnectionTimeoutError,
  APIUserAbortError,
} from './errors.ts';
export {
  SIGNATURE_HEADER,
  signRequest,
  stringToSign,
  sha256Hex,
  createNonce,
  type SignRequestInput,
  type RequestSignature,
} from './signing.ts';
export { createSigningFetch, type SigningFetchOptions } from './signing-fetch.ts';
export type * from './types.ts';
