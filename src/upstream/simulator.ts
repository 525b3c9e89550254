// Test mode: a built-in stand-in for the upstream, so integrations can be tested for free.
// The model name chooses the behaviour (docs/api.md, "Test mode"):
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

export interface TestBehaviour {
  kind: 'delay' | 'fail' | 'error';
  /** The milliseconds, attempts or HTTP status that the model names. */
  value: number;
}

/** What a test-mode model asks of the simulator (the list above); undefined: it completes at once. */
export function testBehaviour(model: string): TestBehaviour | undefined {
  const match = /^test-(delay|fail|error)-(\d+)$/.exec(model);
  return match ? { kind: match[1] as TestBehaviour['kind'], value: Number(match[2]) } : undefined;
}

export async function simulate(call: UpstreamCall & { attempt: number }): Promise<AttemptOutcome> {
  const body = JSON.parse(call.body) as SimulatedBody;
  const behaviour = testBehaviour(body.model);

  if (behaviour?.kind === 'delay') await sleep(behaviour.value, call.signal);
  if (call.signal.aborted) {
    return { ok: false, code: 'upstream_timeout', detail: 'no complete answer within the upstream timeout', upstreamStatus: null };
  }
  if (behaviour?.kind === 'fail' && call.attempt <= behaviour.value) return failedWithStatus(500);
  if (behaviour?.kind === 'error') {
    const status = behaviour.value;
    if (status >= 100 && status <= 599 && (status < 200 || status >= 300)) return failedWithStatus(status);
  }
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
