// For the client's tests: a scripted fetch that records what the client sends, and a check of
// Svc-Signature written with node:crypto, independently of the library's Web Crypto signer.
import { createHash, createHmac, timingSafeEqual } from 'node:crypto';
import { pauseTimer } from '../../src/client/retry.ts';

export const SECRET = 'svc_sig_0123456789abcdefghijklmnopqrstuvwxyzABCDEF';
export const API_KEY = 'svc_test_0123456789abcdefghijklmnopqrstuvwxyzABCDEF';
export const BASE_URL = 'http://gateway.test';

export interface SentCall {
  url: string;
  method: string;
  headers: Headers;
  /** The body as sent, as text ('' for none). */
  body: string;
  /** The parsed JSON body, or undefined. */
  json: any;
  signal: AbortSignal | undefined;
}

/** What the scripted fetch does for one call: answer, drop the connection, or never answer. */
export type Scripted = Response | 'drop' | 'hang' | ((call: SentCall) => Response | 'drop' | 'hang');

/**
 * A fetch answering the nth call with `script[n]` (the last entry repeats). `hang` ignores the
 * abort signal on purpose: the client must time out even when its fetch does not.
 */
export function scriptedFetch(script: Scripted[]) {
  const calls: SentCall[] = [];
  const fetch = async (input: string | URL | Request, init: RequestInit = {}): Promise<Response> => {
    const request = new Request(input, init);
    const body = request.body === null ? '' : await request.text();
    const call: SentCall = {
      url: request.url,
      method: request.method,
      headers: request.headers,
      body,
      json: body === '' ? undefined : JSON.parse(body),
      signal: init.signal ?? undefined,
    };
    calls.push(call);
    let step = script[Math.min(calls.length - 1, script.length - 1)]!;
    if (typeof step === 'function') step = step(call);
    if (step === 'drop') throw new TypeError('fetch failed', { cause: new Error('other side closed') });
    if (step === 'hang') return new Promise<never>(() => {});
    return step.clone();
  };
  return { fetch, calls };
}

export function jsonResponse(status: number, body: unknown, headers: Record<string, string> = {}): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'content-type': 'application/json', ...headers } });
}

export function errorResponse(
  status: number,
  error: { type: string; code: string; param?: string | null; message?: string },
  headers: Record<string, string> = {},
): Response {
  return jsonResponse(
    status,
    { error: { message: error.message ?? `${error.code} happened`, type: error.type, code: error.code, param: error.param ?? null } },
    headers,
  );
}

export const completion = (content = 'hello') => ({
  id: 'chatcmpl-abc123',
  object: 'chat.completion',
  created: 1_776_000_000,
  model: 'test-echo',
  choices: [{ index: 0, message: { role: 'assistant', content }, finish_reason: 'stop' }],
  usage: { prompt_tokens: 5, completion_tokens: 2, total_tokens: 7 },
});

export const record = (status: string, extra: Record<string, unknown> = {}) => ({
  id: 'req_0123456789abcdefghijklmn',
  status,
  attempts: status === 'queued' ? 0 : 1,
  created_at: '2026-04-20T10:00:07.123Z',
  updated_at: '2026-04-20T10:00:07.456Z',
  last_error_code: null,
  ...extra,
});

export interface CheckedSignature {
  timestamp: number;
  nonce: string;
  signature: string;
  /** The HMAC matches the one computed here, over `path` and the body as sent. */
  valid: boolean;
}

/** Parses Svc-Signature and recomputes its HMAC with node:crypto (docs/signing.md). */
export function checkSignature(
  header: string | null,
  request: { secret: string; method: string; path: string; body: string | Uint8Array },
): CheckedSignature {
  const match = /^t=(\d+),n=([A-Za-z0-9_-]{16,64}),v1=([0-9a-f]{64})$/.exec(header ?? '');
  if (!match) throw new Error(`malformed Svc-Signature: ${header}`);
  const [, t, n, v1] = match as unknown as [string, string, string, string];
  const lines = ['v1', t, n, request.method.toUpperCase(), request.path, createHash('sha256').update(request.body).digest('hex')];
  const expected = createHmac('sha256', Buffer.from(request.secret, 'utf8')).update(lines.join('\n')).digest();
  const valid = timingSafeEqual(expected, Buffer.from(v1, 'hex'));
  return { timestamp: Number(t), nonce: n, signature: v1, valid };
}

/** The signature check of a call the scripted fetch recorded; the path is taken from its URL. */
export function checkCall(call: SentCall, secret = SECRET): CheckedSignature {
  const url = new URL(call.url);
  return checkSignature(call.headers.get('svc-signature'), {
    secret,
    method: call.method,
    path: url.pathname + url.search,
    body: call.body,
  });
}

/**
 * Records each pause the client takes (between retries, between polls) in place of waiting it
 * out: `ms` is what it asked for. Each ends at once unless `end` says 'never' for it (for the
 * client's signal to end it, or nothing to). The timer is the client's again at the test's end.
 */
export function recordPauses(
  t: { teardown(fn: () => void): void },
  end: (ms: number, index: number) => 'now' | 'never' = () => 'now',
): number[] {
  const pauses: number[] = [];
  const { set, clear } = pauseTimer;
  pauseTimer.set = (fire, ms) => {
    const ending = end(ms, pauses.length);
    pauses.push(ms);
    return ending === 'now' ? setImmediate(fire) : undefined;
  };
  pauseTimer.clear = (timer) => {
    if (timer !== undefined) clearImmediate(timer as NodeJS.Immediate);
  };
  t.teardown(() => Object.assign(pauseTimer, { set, clear }));
  return pauses;
}
