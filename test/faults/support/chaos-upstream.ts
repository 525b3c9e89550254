// An OpenAI-compatible upstream on loopback that fails at random: each call to
// POST /v1/chat/completions gets a behaviour drawn from a seeded generator (a completion, 429
// with retry-after, 5xx, other 4xx, a reset connection before or in the middle of the answer,
// a hang or a stalled body past the gateway's upstream timeout, or a 2xx that is not a chat
// completion), and every call is remembered with what it was answered, so a test can work out
// which code each attempt of each request must have ended with.
import http from 'node:http';
import { listenOnLoopback } from '../../helpers/ports.ts';
import type { Teardown } from '../../helpers/teardown.ts';

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
  /** Which request this call was for, as `tagOf` read it from the body. */
  tag: string;
  behaviour: Behaviour;
  /** The HTTP status sent, if one was. */
  status: number | null;
  /** The completion sent, for `ok`. */
  completion: Record<string, unknown> | undefined;
  /** When its headers arrived, and when it was answered (or cut, or left hanging). */
  receivedAt: number;
  answeredAt: number;
  authorization: string | undefined;
  body: any;
}

export interface ChaosUpstream {
  baseUrl: string;
  calls: ChaosCall[];
  callsFor(tag: string): ChaosCall[];
}

export async function startChaosUpstream(
  t: Teardown,
  options: { seed: number; tagOf: (body: any) => string },
): Promise<ChaosUpstream> {
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
  const server = http.createServer(async (request, response) => {
    const receivedAt = Date.now();
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    if (request.method !== 'POST' || request.url !== '/v1/chat/completions') {
      response.writeHead(404).end();
      return;
    }
    const body = JSON.parse(Buffer.concat(chunks).toString('utf8'));
    const behaviour = draw();
    const call: ChaosCall = {
      tag: options.tagOf(body),
      behaviour,
      status: null,
      completion: undefined,
      receivedAt,
      answeredAt: Date.now(),
      authorization: request.headers.authorization,
      body,
    };
    calls.push(call);
    byTag.set(call.tag, [...(byTag.get(call.tag) ?? []), call]);

    const answer = (status: number, text: string, headers: Record<string, string> = {}) => {
      call.status = status;
      response.writeHead(status, { 'content-type': 'application/json', ...headers });
      response.end(text);
    };
    switch (behaviour) {
      case 'ok':
        call.completion = completionFor(body);
        return answer(200, JSON.stringify(call.completion));
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
        request.socket.destroy();
        return;
      case 'reset_mid_body':
        call.status = 200;
        response.writeHead(200, { 'content-type': 'application/json', 'content-length': '4096' });
        response.write('{"id":"chatcmpl-cut","object":"chat.completion","choi');
        setTimeout(() => request.socket.destroy(), 5);
        return;
      case 'hang':
        return; // the gateway's upstream timeout must end it
      case 'stalled_body':
        call.status = 200;
        response.writeHead(200, { 'content-type': 'application/json', 'content-length': '4096' });
        response.write('{"id":"chatcmpl-stalled","object":"chat.comp');
        return;
      case 'not_json':
        return answer(200, pick(['<html><body>Bad Gateway</body></html>', 'OK', '\u0000\u00ff garbage \ud83d']));
      case 'truncated_json':
        return answer(200, JSON.stringify(completionFor(body)).slice(0, 40));
      case 'not_a_completion':
        return answer(200, pick(['{"object":"list","data":[]}', '{"id":"chatcmpl-x","object":"chat.completion.chunk","choices":[]}', '{"error":null}', '{"id":42,"object":"chat.completion","choices":[]}']));
      case 'json_array':
        return answer(200, '[{"object":"chat.completion"}]');
      case 'empty_2xx':
        return answer(pick([200, 201, 204]), '');
    }
  });
  // The gateway, not this server, decides when a kept-alive connection ends: a connection this
  // server closed just as a call was sent on it would be a failure it never answered.
  server.keepAliveTimeout = 120_000;
  const port = await listenOnLoopback(t, server);
  return { baseUrl: `http://127.0.0.1:${port}/v1`, calls, callsFor: (tag) => byTag.get(tag) ?? [] };
}

function completionFor(body: { model?: string; messages?: { content: string }[] }) {
  return {
    id: `chatcmpl-chaos${Math.random().toString(36).slice(2)}`,
    object: 'chat.completion',
    created: Math.floor(Date.now() / 1000),
    model: body.model ?? 'chaos',
    choices: [{ index: 0, message: { role: 'assistant', content: `echo: ${body.messages?.at(-1)?.content ?? ''}` }, finish_reason: 'stop' }],
    usage: { prompt_tokens: 3, completion_tokens: 3, total_tokens: 6 },
  };
}

/** A small seeded generator, so a run's mix of behaviours can be told by its seed. */
function mulberry32(seed: number): () => number {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let z = state;
    z = Math.imul(z ^ (z >>> 15), z | 1);
    z ^= z + Math.imul(z ^ (z >>> 7), z | 61);
    return ((z ^ (z >>> 14)) >>> 0) / 4294967296;
  };
}
