// The prompt token estimate made before a call, for lanes with tokens_per_minute.
import { createRequire } from 'node:module';
import t from 'tap';
import { encode } from 'gpt-tokenizer/encoding/o200k_base';
import { estimatePromptTokens } from '../../src/lanes/tokens.ts';

const body = (...messages: { role: string; content: string }[]) => ({ model: 'gpt-4o', messages });

t.test('a short chat counts as OpenAI counts it: 3 a message, its role and content, and 3 for the reply', async (t) => {
  const system = 'You are a terse assistant.';
  const user = 'What is the capital of France? Answer in one word.';
  const expected = 3 + (3 + encode('system').length + encode(system).length) + (3 + encode('user').length + encode(user).length);
  t.equal(estimatePromptTokens(body({ role: 'system', content: system }, { role: 'user', content: user })), expected);
  t.equal(estimatePromptTokens(body({ role: 'user', content: '' })), 3 + 3 + encode('user').length, 'an empty message');
});

t.test('more text gives more tokens', async (t) => {
  const short = estimatePromptTokens(body({ role: 'user', content: 'Hello there.' }));
  const longer = estimatePromptTokens(body({ role: 'user', content: 'Hello there. '.repeat(50) }));
  const twoMessages = estimatePromptTokens(body({ role: 'user', content: 'Hello there.' }, { role: 'user', content: 'Hello there.' }));
  t.ok(longer > short * 10, `${longer} > 10 x ${short}`);
  t.ok(twoMessages > short, `${twoMessages} > ${short}`);
});

t.test('text spelling a special token is counted as text, not refused', async (t) => {
  const content = 'Ignore <|endoftext|> this';
  t.equal(
    estimatePromptTokens(body({ role: 'user', content })),
    3 + 3 + encode('user').length + encode(content, { disallowedSpecial: new Set() }).length,
  );
});

t.test('a 4 MiB body is estimated quickly and close to its exact count', async (t) => {
  const sentence = 'The quick brown fox jumps over the lazy dog, and the gateway counts its tokens. ';
  const prose = sentence.repeat(Math.ceil((4 * 1024 * 1024) / sentence.length));
  // In a run of sentences each one costs what the second of two does (the first has no space before it).
  const perSentence = encode(sentence + sentence).length - encode(sentence).length;
  const exact = 3 + 3 + encode('user').length + perSentence * (prose.length / sentence.length);
  const estimate = estimatePromptTokens(body({ role: 'user', content: prose }));
  t.ok(Math.abs(estimate - exact) / exact < 0.05, `${estimate} within 5% of ${exact}`);

  // Random letters defeat the tokenizer's cache: tokenised whole, 4 MiB of them would take
  // minutes, and one long piece of them time that grows with its square. What the tokenizer is
  // given (the encoding module that estimatePromptTokens loads, watched here) shows it quick: at
  // most 4 KiB of the body, in pieces of at most 512 characters (TOKENIZED_CHARS, PIECE_CHARS).
  let letters = '';
  while (letters.length < 4 * 1024 * 1024) letters += Math.random().toString(36).slice(2).replace(/\d/g, '');
  const tokenizer = createRequire(import.meta.url)('gpt-tokenizer/encoding/o200k_base') as { countTokens: (text: string, ...rest: unknown[]) => number };
  const { countTokens } = tokenizer;
  const given: string[] = [];
  tokenizer.countTokens = (text, ...rest) => (given.push(text), countTokens(text, ...rest));
  t.teardown(() => void (tokenizer.countTokens = countTokens));
  const randomEstimate = estimatePromptTokens(body({ role: 'user', content: letters }));
  tokenizer.countTokens = countTokens;
  t.ok(randomEstimate > letters.length / 8 && randomEstimate < letters.length, `${randomEstimate} tokens for ${letters.length} letters`);
  const ofBody = given.filter((text) => text !== 'user');
  t.ok(ofBody.length > 0 && ofBody.every((text) => letters.includes(text)), 'the tokenizer is given pieces of the body');
  const tokenised = ofBody.reduce((sum, text) => sum + text.length, 0);
  t.ok(tokenised <= 4 * 1024, `${tokenised} of its ${letters.length} characters tokenised`);
  t.ok(ofBody.every((text) => text.length <= 512), `in pieces of at most 512 (${Math.max(...ofBody.map((text) => text.length))})`);
});
