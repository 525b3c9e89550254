// The shapes the gateway accepts and answers (docs/api.md, docs/errors.md and docs/webhooks.md).

export type ChatRole = 'system' | 'developer' | 'user' | 'assistant';

export interface ChatMessage {
  role: ChatRole;
  content: string;
}

/** The body of POST /v1/chat/completions: these fields and no others. */
export interface ChatCompletionCreateParams {
  /** 1 to 256 characters. With a test key, `test-delay-<ms>`, `test-fail-<n>` and `test-error-<status>` drive the simulator. */
  model: string;
  /** 1 to 2048 messages. */
  messages: ChatMessage[];
  /** 0 to 2. */
  temperature?: number | undefined;
  /** 0 to 1. */
  top_p?: number | undefined;
  /** -2 to 2. */
  presence_penalty?: number | undefined;
  /** -2 to 2. */
  frequency_penalty?: number | undefined;
  /** A whole number, at least 1. */
  max_tokens?: number | undefined;
  /** true: hold the call open until the request completes or the server's wait timeout passes. Default false. */
  wait?: boolean | undefined;
  /**
   * 1 to 255 printable ASCII characters. Sending the same key with the same body again answers
   * the same request instead of creating a second one. When omitted, the client generates one
   * per call, so its own retries never create a second request.
   */
  idempotency_key?: string | undefined;
  /** Streaming is not supported in v1. */
  stream?: false | undefined;
}

/** The upstream's chat completion, as the gateway stores and returns it. */
export interface ChatCompletion {
  id: string;
  object: 'chat.completion';
  created: number;
  model: string;
  choices: ChatCompletionChoice[];
  usage?: CompletionUsage;
  system_fingerprint?: string | null;
}

export interface ChatCompletionChoice {
  index: number;
  message: { role: 'assistant'; content: string | null; refusal?: string | null };
  finish_reason: 'stop' | 'length' | 'tool_calls' | 'content_filter' | 'function_call' | (string & {});
  logprobs?: unknown;
}

export interface CompletionUsage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

/** queued, processing and retrying are on the way; completed, failed and cancelled are final. */
export type RequestStatus = 'queued' | 'processing' | 'retrying' | 'completed' | 'failed' | 'cancelled';

/** The answer when the request is not (yet) completed: keep the id and look it up later. */
export interface ChatCompletionAsync {
  /** The gateway's request id (`req_...`), never a `chatcmpl-` id. */
  id: string;
  object: 'chat.completion.async';
  /**
   * `queued` without `wait`; with `wait: true`, the status when the answer was sent: on the way
   * when the server's wait ran out, or `failed` or `cancelled` when the request ended so.
   */
  status: RequestStatus;
  /** Unix seconds. */
  created: number;
}

/** What create() resolves to: tell the two apart by `object`. */
export type ChatCompletionCreateResult = ChatCompletion | ChatCompletionAsync;

/**
 * Why the most recent failed attempt failed, or why the request failed without one (docs/errors.md,
 * "Attempt error codes").
 */
export type AttemptErrorCode =
  | 'upstream_timeout'
  | 'upstream_connection_error'
  | 'upstream_rate_limited'
  | 'upstream_server_error'
  | 'upstream_invalid_response'
  | 'worker_lost'
  | 'upstream_bad_request'
  | 'upstream_auth_error'
  | 'deadline_exceeded'
  | (string & {});

interface RequestRecordFields {
  id: string;
  attempts: number;
  /** ISO 8601 UTC. */
  created_at: string;
  /** ISO 8601 UTC. */
  updated_at: string;
  last_error_code: AttemptErrorCode | null;
}

export interface PendingRequestRecord extends RequestRecordFields {
  status: 'queued' | 'processing' | 'retrying';
}

export interface CompletedRequestRecord extends RequestRecordFields {
  status: 'completed';
  result: ChatCompletion;
}

export interface FailedRequestRecord extends RequestRecordFields {
  status: 'failed';
}

/** Cancelled by a client before it finished; `last_error_code` stays what it was. */
export interface CancelledRequestRecord extends RequestRecordFields {
  status: 'cancelled';
}

/** GET /v1/requests/{id}: `result` is there exactly when the status is completed. */
export type RequestRecord = PendingRequestRecord | CompletedRequestRecord | FailedRequestRecord | CancelledRequestRecord;

/** A record that will never change again. */
export type TerminalRequestRecord = CompletedRequestRecord | FailedRequestRecord | CancelledRequestRecord;

/** The events a webhook endpoint can subscribe to: one per terminal status. */
export type WebhookEventType = 'request.completed' | 'request.failed' | 'request.cancelled';

interface WebhookEventFields {
  /** ISO 8601 UTC: when the event happened. */
  timestamp: string;
}

export interface RequestCompletedEvent extends WebhookEventFields {
  type: 'request.completed';
  data: CompletedRequestRecord;
}

export interface RequestFailedEvent extends WebhookEventFields {
  type: 'request.failed';
  data: FailedRequestRecord;
}

export interface RequestCancelledEvent extends WebhookEventFields {
  type: 'request.cancelled';
  data: CancelledRequestRecord;
}

/** The body of a webhook delivery (docs/webhooks.md, "What is sent"): tell the events apart by `type`. */
export type WebhookEvent = RequestCompletedEvent | RequestFailedEvent | RequestCancelledEvent;

/** The error body of every failure (docs/errors.md, "The error object"). */
export interface ErrorObject {
  message: string;
  type: string;
  code: string;
  param: string | null;
}
