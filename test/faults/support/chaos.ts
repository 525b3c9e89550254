// The script of an upstream that fails at random (test/helpers/upstream.ts runs it): each call to
// POST /v1/chat/completions gets a behaviour drawn from a seeded generator (a completion, 429
// with retry-after, 5xx, other 4xx, a reset connection before or in the middle of the answer,
// a hang or a stalled body past the gateway's upstream timeout, or a 2xx that is not a chat
// completion), and every call is remembered with what it was answered, so a test can work out
// which code each attempt of each request must have ended with.
import { mulberry32 } from '../../helpers/random.ts';
import { completionFor, type ReceivedCall, type Reply } from '../../helpers/upstream.ts';

export const BEHAVIOURS = {
  ok: { weight: 38, code: null },
  rate_limited: { weight: 8, code: 'upstream_rate_limited' },
  server_error: { weight: 10, code: 'upstream_server_error' },
  timeout_or_conflict: { weight: 4, code: 'upstream_server_error' },
  bad_request: { weight: 3, code: 'upstream_bad_request' },
  unauthorized: { weight: 2, code: 'upstream_auth_error' },
  reset: { weight: 8, code: 'upstream_connection_error' },
  reset_mid_body: { weight: 4, code: 'upstream_connection_error' },
  hang: { weight: 4, code: 'upstream_timeout' },
  stalled_body: { weight: 3, code: 'upstream_timeout' },
  not_json: { weight: 5, code: 'upstream_invalid_response' },
  truncated_json: { weight: 2, code: 'upstream_invalid_response' },
  not_a_completion: { weight: 5, code: 'upstream_invalid_response' },
  json_array: { weight: 2, code: 'upstream_invalid_response' },
  empty_2xx: { weight: 2, code: 'upstream_invalid_response' },
} as const;

export type Behaviour = keyof typeof BEHAVIOURS;

/** The retried attempt codes: all but upstream_bad_request (the request's own fault). */
export const RETRYABLE = new Set([
  'upstream_timeout',
  'upstream_connection_error',
  'upstream_rate_limited',
  'upstream_server_error',
  'upstream_invalid_response',
  'upstream_auth_error',
  'worker_lost',
]);

export interface ChaosCall {
  /** The call as the upstream received and answered it (its status, when it arrived). */
  received: ReceivedCall;
  /** Which request this call was for, as `tagOf` read it from the body. */
  tag: string;
  behaviour: Behaviour;
  /** The completion sent, for `ok`. */
  completion: Record<string, unknown> | undefined;
}

export interface Chaos {
  /** The upstream's script: answers each call as the behaviour drawn for it. */
  reply(call: ReceivedCall): Reply;
  calls: ChaosCall[];
  callsFor(tag: string): ChaosCall[];
}

export function chaos(options: { seed: number; tagOf: (body: any) => string }): Chaos {
  const random = mulberry32(options.seed);
  const pick = <T>(items: readonly T[]): T => items[Math.floor(random() * items.length)]!;
  const total = Object.values(BEHAVIOURS).reduce((sum, behaviour) => sum + behaviour.weight, 0);
  const draw = (): Behaviour => {
    let at = random() * total;
    for (const [name, behaviour] of Object.entries(BEHAVIOURS)) {
      at -= behaviour.weight;
      if (at < 0) return name as Behaviour;
    }
    return 'ok';
  };

  const calls: ChaosCall[] = [];
  const byTag = new Map<string, ChaosCall[]>();
  const reply = (received: ReceivedCall): Reply => {
    const behaviour = draw();
    const chaosCall: ChaosCall = { received, tag: options.tagOf(received.body), behaviour, completion: undefined };
    calls.push(chaosCall);
    byTag.set(chaosCall.tag, [...(byTag.get(chaosCall.tag) ?? []), chaosCall]);

    const answer = (status: number, text: string, headers: Record<string, string> = {}): Reply => ({ status, text, headers });
    const started = (text: string) => ({ status: 200, text, headers: { 'content-length': '4096' } });
    switch (behaviour) {
      case 'ok':
        chaosCall.completion = completionFor(received.body);
        return answer(200, JSON.stringify(chaosCall.completion));
      case 'rate_limited':
        return answer(429, '{"error":{"message":"slow down"}}', { 'retry-after': pick(['0', '1']) });
      case 'server_error':
        return answer(pick([500, 502, 503, 504]), '{"error":{"message":"upstream trouble"}}');
      case 'timeout_or_conflict':
        return answer(pick([408, 409]), '{"error":{"message":"try again"}}');
      case 'bad_request':
        return answer(pick([400, 404, 413, 422]), '{"error":{"message":"bad request"}}');
      case 'unauthorized':
        return answer(pick([401, 403]), '{"error":{"message":"who are you"}}');
      case 'reset':
        return { reset: true };
      case 'reset_mid_body':
        return { ...started('{"id":"chatcmpl-cut","object":"chat.completion","choi'), partial: 'reset' };
      case 'hang':
        return { hang: true }; // the gateway's upstream timeout must end it
      case 'stalled_body':
        return { ...started('{"id":"chatcmpl-stalled","object":"chat.comp'), partial: 'hold' };
      case 'not_json':
        return answer(200, pick(['<html><body>Bad Gateway</body></html>', 'OK', '\u0000\u00ff garbage \ud83d']));
      case 'truncated_json':
        return answer(200, JSON.stringify(completionFor(received.body)).slice(0, 40));
      case 'not_a_completion':
        return answer(200, pick(['{"object":"list","data":[]}', '{"id":"chatcmpl-x","object":"chat.completion.chunk","choices":[]}', '{"error":null}', '{"id":42,"object":"chat.completion","choices":[]}']));
      case 'json_array':
        return answer(200, '[{"object":"chat.completion"}]');
      case 'empty_2xx':
        return answer(pick([200, 201, 204]), '');
    }
  };
  return { reply, calls, callsFor: (tag) => byTag.get(tag) ?? [] };
}
