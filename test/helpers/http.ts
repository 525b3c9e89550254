// Talking to a test gateway over real HTTP, as its clients do.
import type { CreatedKey } from '../../src/keys/service.ts';
import { signature } from './signing.ts';

export interface Answer {
  status: number;
  headers: Headers;
  /** Parsed JSON, or the raw text when the body is not JSON. */
  body: any;
  text: string;
}

export interface RawRequest {
  method?: string;
  path: string;
  /** An object is sent as JSON; a string or Buffer as it is. */
  body?: unknown;
  headers?: Record<string, string>;
  /** A created key signs what it sends with its signing secret; a bare string is only a bearer key. */
  key?: CreatedKey | string | null;
  /** false: send no Svc-Signature (a `headers` entry still wins either way). */
  sign?: boolean;
}

export async function send(baseUrl: string, request: RawRequest): Promise<Answer> {
  const headers: Record<string, string> = {};
  let body: string | Buffer | undefined;
  if (request.body !== undefined) {
    body = typeof request.body === 'string' || Buffer.isBuffer(request.body) ? request.body : JSON.stringify(request.body);
    headers['content-type'] = 'application/json';
  }
  const method = request.method ?? (body === undefined ? 'GET' : 'POST');
  const apiKey = typeof request.key === 'string' ? request.key : request.key?.api_key;
  if (apiKey) headers.authorization = `Bearer ${apiKey}`;
  if (request.key && typeof request.key === 'object' && request.sign !== false) {
    headers['svc-signature'] = signature({
      secret: request.key.signing_secret,
      method,
      path: request.path,
      ...(body === undefined ? {} : { body }),
    });
  }
  Object.assign(headers, request.headers);
  const response = await fetch(`${baseUrl}${request.path}`, {
    method,
    headers,
    ...(body === undefined ? {} : { body }),
  });
  const text = await response.text();
  let parsed: unknown = text;
  try {
    parsed = JSON.parse(text);
  } catch {}
  return { status: response.status, headers: response.headers, body: parsed, text };
}

/** A client bound to one gateway and key: post a completion, look a request up. */
export function clientFor(baseUrl: string, key: CreatedKey | string | null) {
  return {
    post: (body: unknown, headers: Record<string, string> = {}) =>
      send(baseUrl, { path: '/v1/chat/completions', body, headers, key }),
    get: (id: string, headers: Record<string, string> = {}) =>
      send(baseUrl, { path: `/v1/requests/${encodeURIComponent(id)}`, headers, key }),
  };
}

export const userMessage = (content = 'Hello there') => [{ role: 'user', content }];
