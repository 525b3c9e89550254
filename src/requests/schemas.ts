// The body of POST /v1/chat/completions (docs/api.md, "Submitting a request"), and how a body
// that breaks it is explained: one ApiError naming the first parameter at fault.
import { hash } from 'node:crypto';
import * as v from 'valibot';
import { ApiError, invalidRequest } from '../errors.ts';

const number = (min: number, max: number) =>
  v.optional(
    v.pipe(
      v.number(`expected a number from ${min} to ${max}`),
      v.minValue(min, `expected a number from ${min} to ${max}`),
      v.maxValue(max, `expected a number from ${min} to ${max}`),
    ),
  );

/** The code points of a string. */
function characters(text: string): number {
  let count = 0;
  for (const _ of text) count++;
  return count;
}

export const Message = v.strictObject({
  role: v.picklist(
    ['system', 'developer', 'user', 'assistant'],
    'expected one of "system", "developer", "user", "assistant"',
  ),
  content: v.string('expected a string'),
}, 'expected an object with "role" and "content"');

export type Message = v.InferOutput<typeof Message>;

export const CreateCompletion = v.strictObject({
  model: v.pipe(
    v.string('expected a string'),
    // Characters are code points: a string's length counts two for one outside the BMP. A string
    // of more than 512 units has more than 256 of them, and is not walked through.
    v.check((model) => model.length > 0 && model.length <= 512 && characters(model) <= 256, 'expected 1 to 256 characters'),
    // Postgres text holds no NUL: refused here rather than failing as the row is stored.
    v.check((model) => !model.includes('\u0000'), 'expected no NUL character'),
  ),
  // Their number is checked before the messages are: a body of MAX_BODY_BYTES holds millions of
  // them, and looking at each would make an issue of each bad one (seconds and gigabytes).
  messages: v.pipe(
    v.custom<unknown[]>(Array.isArray, 'expected an array of messages'),
    v.minLength(1, 'expected 1 to 2048 messages'),
    v.maxLength(2048, 'expected 1 to 2048 messages'),
    v.array(Message, 'expected an array of messages'),
  ),
  temperature: number(0, 2),
  top_p: number(0, 1),
  presence_penalty: number(-2, 2),
  frequency_penalty: number(-2, 2),
  max_tokens: v.optional(
    v.pipe(
      v.number('expected a whole number of at least 1'),
      v.safeInteger('expected a whole number of at least 1'),
      v.minValue(1, 'expected a whole number of at least 1'),
    ),
  ),
  wait: v.optional(v.boolean('expected true or false')),
  idempotency_key: v.optional(
    v.pipe(
      v.string('expected a string'),
      v.regex(/^[\x20-\x7e]{1,255}$/, 'expected 1 to 255 printable ASCII characters'),
    ),
  ),
  stream: v.optional(v.literal(false, 'expected false')),
});
export type CreateCompletion = v.InferOutput<typeof CreateCompletion>;

/** A validated submission, split into what goes upstream and what is ours. */
export interface Submission {
  /** Canonical JSON text of the body minus wait, idempotency_key and stream: what is sent upstream. */
  body: string;
  bodySha256: Buffer;
  model: string;
  /** As parsed: what a prompt token estimate counts. */
  messages: readonly Message[];
  wait: boolean;
  idempotencyKey: string | undefined;
}

/** Validates a parsed JSON body; throws the contract's 400 for the first problem found. */
export function parseSubmission(input: unknown): Submission {
  if (typeof input !== 'object' || input === null || Array.isArray(input)) {
    throw invalidRequest('invalid_body', 'The body must be a JSON object.');
  }
  if ((input as { stream?: unknown }).stream === true) {
    throw invalidRequest('stream_not_supported', 'Streaming is not supported in v1; send "stream": false or omit it.', 'stream');
  }
  const parsed = v.safeParse(CreateCompletion, input);
  if (!parsed.success) throw explain(parsed.issues);
  const { wait, idempotency_key, stream: _stream, ...upstream } = parsed.output;
  const body = canonicalJson(upstream);
  return {
    body,
    bodySha256: hash('sha256', body, 'buffer'),
    model: upstream.model,
    messages: upstream.messages,
    wait: wait ?? false,
    idempotencyKey: idempotency_key,
  };
}

type Issue = v.InferIssue<typeof CreateCompletion>;

// Unknown parameters are reported first, then missing ones, then invalid values, so the
// answer does not depend on the order of the keys in the body.
function explain(issues: readonly Issue[]): ApiError {
  const unknown = issues.find((issue) => issue.type === 'strict_object' && issue.expected === 'never');
  if (unknown) {
    const param = paramOf(unknown);
    return invalidRequest('unknown_parameter', `Unknown parameter: '${param}'.`, param);
  }
  const missing = issues.find((issue) => issue.type === 'strict_object' && issue.received === 'undefined');
  if (missing) {
    const param = paramOf(missing);
    return invalidRequest('missing_parameter', `Missing required parameter: '${param}'.`, param);
  }
  const invalid = issues[0]!;
  const param = paramOf(invalid);
  return invalidRequest('invalid_parameter', `Invalid '${param}': ${invalid.message}.`, param);
}

/** messages[0].role, in the style of the third-party API's error params. */
function paramOf(issue: Issue): string {
  let param = '';
  for (const item of issue.path ?? []) {
    param += typeof item.key === 'number' ? `[${item.key}]` : `${param ? '.' : ''}${String(item.key)}`;
  }
  return param;
}

/** JSON with object keys sorted, so equal bodies have equal text whatever their key order. */
export function canonicalJson(value: unknown): string {
  return JSON.stringify(value, (_key, item: unknown) =>
    item !== null && typeof item === 'object' && !Array.isArray(item)
      ? Object.fromEntries(Object.entries(item).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)))
      : item,
  );
}
