// chat-gateway/client: the zero-dependency client of the gateway (README.md beside it; docs/api.md).
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
} from './client.ts';
export type { RequestOptions } from './request.ts';
export { Chat, Completions } from './resources/chat.ts';
export { Requests, type PollOptions } from './resources/requests.ts';
export { Webhooks, type WebhookHeaders } from './resources/webhooks.ts';
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
  WebhookVerificationError,
  type WebhookVerificationErrorCode,
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
export {
  WEBHOOK_SECRET_PREFIX,
  WEBHOOK_TOLERANCE_SECONDS,
  signWebhook,
  webhookSignatureMatches,
  type WebhookBody,
} from './webhooks.ts';
export type * from './types.ts';
