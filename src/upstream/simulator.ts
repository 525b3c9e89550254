// Test mode: a built-in stand-in for the upstream, so integrations can be tested for free.
// The model name chooses the behaviour (CONTRACT.md section 4):
//   test-delay-<ms>     completes after that many milliseconds
//   test-fail-<n>       the first n attempts fail with upstream_server_error, then it completes
//   test-error-<status> every attempt fails as if the upstream answered that HTTP status
//   anything else       completes at once, echoing the last message
import { randomBase62 } from '../ids.ts';
import type { UpstreamCall } from './openai.ts';
import type { AttemptOutcome } from './outcome.ts';
import { failedWithStatus } from './outcome.ts';

interface SimulatedBody {
  model: string;
  messages: { role: string; content: string }[];
}

export async function simulate(call: UpstreamCall & { attempt: number }): Promise<AttemptOutcome> {
  const body = JSON.parse(call.body) as SimulatedBody;
  const behaviour = /^test-(delay|fail|error)-(\d{1,9})$/.exec(body.model);
  const kind = behaviour?.[1];
  const value = Number(behaviour?.[2]);

  if (kind === 'delay') await sleep(value, call.signal);
  if (call.signal.aborted) {
    return { ok: false, code: 'upstream_timeout', detail: 'no complete answer within the upstream timeout', upstreamStatus: null };
  }
  if (kind === 'fail' && call.attempt <= value) return failedWithStatus(500);
  if (kind === 'error' && value >= 100 && value <= 599 && (value < 200 || value >= 300)) return failedWithStatus(value);
  const completion = completionFor(body);
  const { usage } = completion;
  return {
    ok: true,
    result: JSON.stringify(completion),
    upstreamStatus: 200,
    usage: { prompt: usage.prompt_tokens, completion: usage.completion_tokens, total: usage.total_tokens },
  };
}

function completionFor(body: SimulatedBody) {
  const content = body.messages.at(-1)?.content ?? '';
  const promptTokens = body.messages.reduce((sum, message) => sum + estimateTokens(message.content) + 4, 0);
  const completionTokens = estimateTokens(content);
  return {
    id: `chatcmpl-${randomBase62(29)}`,
    object: 'chat.completion',
    created: Math.floor(Date.now() / 1000),
    model: body.model,
    choices: [
      {
        index: 0,
        message: { role: 'assistant', content, refusal: null },
        logprobs: null,
        finish_reason: 'stop',
      },
    ],
    usage: {
      prompt_tokens: promptTokens,
      completion_tokens: completionTokens,
      total_tokens: promptTokens + completionTokens,
    },
  };
}

/** Roughly four characters a token, as the third-party tokenizers average on English. */
const estimateTokens = (text: string) => Math.ceil(text.length / 4);

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal.aborted) return resolve();
    const timer = setTimeout(done, ms);
    signal.addEventListener('abort', done, { once: true });
    function done() {
      clearTimeout(timer);
      signal.removeEventListener('abort', done);
      resolve();
    }
  });
}
