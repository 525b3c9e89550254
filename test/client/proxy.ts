// A loopback proxy in front of a test gateway that fails on cue: for each request it answers a
// scripted 503, forwards it but drops the connection instead of relaying the answer (the request
// reached the gateway; the client never hears back), or forwards it and relays the answer.
import http from 'node:http';
import { listenOnLoopback } from '../helpers/ports.ts';
import { checkSignature, type CheckedSignature } from './support.ts';
import type { Teardown } from '../helpers/teardown.ts';

export type ProxyStep = 'unavailable' | 'forward-then-drop' | 'forward';

export interface ProxiedCall {
  method: string;
  /** Path and query as received. */
  path: string;
  headers: http.IncomingHttpHeaders;
  body: string;
  step: ProxyStep;
  /** The gateway's answer, for forwarded calls. */
  answer?: { status: number; headers: Headers; body: string };
}

/** Starts the proxy; the nth request takes `steps[n]`, and requests past the end are forwarded. */
export async function startFlakyProxy(t: Teardown, target: string, steps: ProxyStep[]) {
  const calls: ProxiedCall[] = [];
  const server = http.createServer(async (request, response) => {
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    const body = Buffer.concat(chunks);
    const call: ProxiedCall = {
      method: request.method ?? 'GET',
      path: request.url ?? '/',
      headers: request.headers,
      body: body.toString('utf8'),
      step: steps[calls.length] ?? 'forward',
    };
    calls.push(call);

    if (call.step === 'unavailable') {
      response.writeHead(503, { 'content-type': 'application/json', 'retry-after': '0' });
      response.end(JSON.stringify({ error: { message: 'Try again.', type: 'api_error', code: 'service_unavailable', param: null } }));
      return;
    }
    const forwarded = await fetch(`${target}${call.path}`, {
      method: call.method,
      headers: Object.entries(request.headers).flatMap(([name, value]) =>
        ['host', 'connection', 'content-length', 'transfer-encoding', 'keep-alive'].includes(name) || value === undefined
          ? []
          : [[name, Array.isArray(value) ? value.join(', ') : value] as [string, string]],
      ),
      ...(body.length > 0 ? { body } : {}),
    });
    call.answer = { status: forwarded.status, headers: forwarded.headers, body: await forwarded.text() };
    if (call.step === 'forward-then-drop') {
      request.socket.destroy();
      return;
    }
    const relayed: Record<string, string> = { 'content-type': forwarded.headers.get('content-type') ?? 'application/json' };
    for (const name of ['idempotent-replayed', 'retry-after']) {
      const value = forwarded.headers.get(name);
      if (value !== null) relayed[name] = value;
    }
    response.writeHead(forwarded.status, relayed);
    response.end(call.answer.body);
  });
  const port = await listenOnLoopback(t, server);
  return { url: `http://127.0.0.1:${port}`, calls };
}

/** Each proxied call's Svc-Signature, checked against the secret (computed with node:crypto). */
export function signaturesOf(calls: readonly ProxiedCall[], secret: string): CheckedSignature[] {
  return calls.map((call) =>
    checkSignature(call.headers['svc-signature'] as string, { secret, method: call.method, path: call.path, body: call.body }),
  );
}
