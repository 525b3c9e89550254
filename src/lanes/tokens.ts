// The prompt tokens a request will use, estimated from its body before the call, for lanes with
// a tokens_per_minute limit (docs/lanes.md, "Lanes"); the answer's usage corrects the estimate.
import { createRequire } from 'node:module';
import type * as O200kBase from 'gpt-tokenizer/encoding/o200k_base';

// OpenAI's cookbook count for chat models: each message is wrapped in 3 tokens of its own, and
// the reply is primed with 3 more.
const TOKENS_PER_MESSAGE = 3;
const REPLY_PRIMING = 3;

// The tokenizer's cost depends on the text: prose is fast, text that defeats its merge cache
// (random letters, CJK) is a hundred times slower, and a single long word grows quadratically.
// It holds the event loop while it runs, so a body is tokenised for at most this many
// characters, shared among its messages by length. A longer message is sampled in pieces spread
// along it, and its length multiplied by the sample's tokens per character: within a few per cent
// on prose and code, and the answer's usage corrects the rest.
const TOKENIZED_CHARS = 4 * 1024;
// Text is tokenised in pieces of this size, which bounds the quadratic case; a cut through a
// word costs a token at most.
const PIECE_CHARS = 512;
// A message whose share is smaller than this is too little to sample; it is counted at
// 4 characters a token, the usual rate for English.
const MIN_SAMPLE_CHARS = 64;
const CHARS_PER_TOKEN = 4;

// Text that spells a special token such as <|endoftext|> is ordinary text to the upstream, so it
// is counted as text rather than refused.
const AS_TEXT = { disallowedSpecial: new Set<string>() };

type Tokenizer = typeof O200kBase;
let loaded: Tokenizer | undefined;

function tokenizer(): Tokenizer {
  // require, not import: the encoding loads on first use, synchronously, and only in the
  // deployments that limit tokens.
  loaded ??= createRequire(import.meta.url)('gpt-tokenizer/encoding/o200k_base') as Tokenizer;
  return loaded;
}

/**
 * Loads the o200k_base encoding, which otherwise happens on estimatePromptTokens's first call and
 * holds the event loop for a noticeable moment; start-up can call it when a lane limits tokens.
 */
export function loadTokenizer(): void {
  tokenizer();
}

export function estimatePromptTokens(body: {
  model: string;
  messages: readonly { role: string; content: string }[];
}): number {
  const { countTokens } = tokenizer();
  const totalChars = body.messages.reduce((sum, message) => sum + message.content.length, 0);
  let tokens = REPLY_PRIMING;
  for (const { role, content } of body.messages) {
    tokens += TOKENS_PER_MESSAGE + countTokens(role, AS_TEXT);
    const share =
      totalChars <= TOKENIZED_CHARS ? content.length : Math.floor((TOKENIZED_CHARS * content.length) / totalChars);
    if (share >= content.length) {
      tokens += countPieces(countTokens, content, 0, content.length);
    } else if (share < MIN_SAMPLE_CHARS) {
      tokens += Math.ceil(content.length / CHARS_PER_TOKEN);
    } else {
      tokens += Math.ceil(sampleRate(countTokens, content, share) * content.length);
    }
  }
  return tokens;
}

/** Tokens per character of text, from about `chars` characters taken in pieces spread along it. */
function sampleRate(countTokens: Tokenizer['countTokens'], text: string, chars: number): number {
  const pieces = Math.max(1, Math.floor(chars / PIECE_CHARS));
  const length = Math.min(PIECE_CHARS, chars);
  let tokens = 0;
  let sampled = 0;
  for (let index = 0; index < pieces; index++) {
    const start = Math.floor((index * (text.length - length)) / Math.max(1, pieces - 1));
    tokens += countPieces(countTokens, text, start, start + length);
    sampled += length;
  }
  return tokens / sampled;
}

/** Tokens in text from start to end, counted piece by piece. */
function countPieces(countTokens: Tokenizer['countTokens'], text: string, start: number, end: number): number {
  let tokens = 0;
  for (let from = start; from < end; ) {
    let to = Math.min(from + PIECE_CHARS, end);
    // Never cut between the two halves of a surrogate pair.
    if (to < text.length && isHighSurrogate(text.charCodeAt(to - 1)) && to - 1 > from) to -= 1;
    tokens += countTokens(text.slice(from, to), AS_TEXT);
    from = to;
  }
  return tokens;
}

function isHighSurrogate(code: number): boolean {
  return code >= 0xd800 && code <= 0xdbff;
}
