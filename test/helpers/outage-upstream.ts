// A real OpenAI-compatible server on loopback whose behaviour the test switches, as a provider's
// outage looks from the gateway: healthy (answers after a latency), answering one status (503,
// 401, ...), hanging (no answer: the gateway's upstream timeout ends the call), or refusing
// connections (its port closed, then listened on again). What a call meets is decided when it
// arrives, so a call that arrived during a hang keeps hanging after the outage ends, as a real
// one would. A call whose last message holds the poison marker is answered 500 whatever the
// mode. Every call is recorded, with when it arrived and ended and what it was answered.
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { completionFor } from './upstream.ts';
import type { Teardown } from './teardown.ts';

export type OutageMode =
  | { kind: 'healthy' }
  | { kind: 'status'; status: number }
  | { kind: 'hang' }
  | { kind: 'refuse' };

export interface OutageCall {
  /** Date.now() when its body had arrived. */
  arrivedAt: number;
  /** Date.now() when it was answered, or its connection closed (a hanging call: when the gateway gave up). */
  endedAt: number | undefined;
  /** What it met: the mode when it arrived, or 'poison'. */
  met: OutageMode['kind'] | 'poison';
  /** The status answered; undefined while hanging or when never answered. */
  status: number | undefined;
  /** The model named in the body, as sent. */
  model: string;
  /** The last message's content. */
  content: string;
}

export interface OutageUpstream {
  /** The upstream's base URL (…/v1), the same across refusals. */
  baseUrl: string;
  port: number;
  calls: OutageCall[];
  mode(): OutageMode;
  /** Switches what calls meet from now on; 'refuse' closes the port (and drops every connection), leaving it listens again. */
  set(mode: OutageMode): Promise<void>;
  /** Calls under way now (arrived, not yet ended). */
  inFlight(): number;
}

export interface OutageUpstreamOptions {
  /** How long a healthy call takes (ms); default 200. */
  latencyMs?: number;
  /** A call whose last message contains this is answered 500 in every mode but refuse. */
  poisonMarker?: string;
  /** The starting mode; default healthy. */
  mode?: OutageMode;
}

const errorBody = (status: number) => ({
  error: {
    message: status === 401 ? 'Incorrect API key provided.' : `The server had an error (HTTP ${status}).`,
    type: status === 401 ? 'invalid_request_error' : 'server_error',
    code: status === 401 ? 'invalid_api_key' : null,
  },
});

export async function startOutageUpstream(t: Teardown, options: OutageUpstreamOptions = {}): Promise<OutageUpstream> {
  const latencyMs = options.latencyMs ?? 200;
  let mode: OutageMode = options.mode ?? { kind: 'healthy' };
  const calls: OutageCall[] = [];
  let inFlight = 0;

  const server = http.createServer(async (request, response) => {
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    if (request.method !== 'POST' || request.url !== '/v1/chat/completions') {
      response.writeHead(404).end();
      return;
    }
    const body = JSON.parse(Buffer.concat(chunks).toString('utf8'));
    const content: string = body.messages?.at(-1)?.content ?? '';
    const poisoned = options.poisonMarker !== undefined && content.includes(options.poisonMarker);
    const met: OutageCall['met'] = poisoned ? 'poison' : mode.kind;
    const call: OutageCall = { arrivedAt: Date.now(), endedAt: undefined, met, status: undefined, model: String(body.model), content };
    calls.push(call);
    inFlight++;
    const end = () => {
      if (call.endedAt !== undefined) return;
      call.endedAt = Date.now();
      inFlight--;
    };
    response.once('close', end);
    const answer = (status: number, json: unknown) => {
      if (response.destroyed) return;
      call.status = status;
      response.writeHead(status, { 'content-type': 'application/json' });
      response.end(JSON.stringify(json));
      end();
    };

    if (poisoned) return answer(500, errorBody(500));
    switch (mode.kind) {
      case 'hang':
        return; // never answered: the gateway's upstream timeout (or its death) ends the call
      case 'status':
        return answer(mode.status, errorBody(mode.status));
      case 'refuse':
        // Arrived on a connection opened just before the port closed.
        request.socket.destroy();
        return;
      case 'healthy':
        await new Promise((resolve) => setTimeout(resolve, latencyMs));
        return answer(200, completionFor(body));
    }
  });
  // Calls are counted by the test, not cut by the server's own request timeouts.
  server.requestTimeout = 0;
  server.headersTimeout = 0;

  const listen = (port: number) =>
    new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen(port, '127.0.0.1', () => {
        server.off('error', reject);
        resolve();
      });
    });
  const close = () =>
    new Promise<void>((resolve) => {
      server.close(() => resolve());
      server.closeAllConnections();
    });

  await listen(0);
  const { port } = server.address() as AddressInfo;
  t.teardown(() => (server.listening ? close() : undefined));

  return {
    baseUrl: `http://127.0.0.1:${port}/v1`,
    port,
    calls,
    mode: () => mode,
    async set(next) {
      const wasRefusing = mode.kind === 'refuse';
      mode = next;
      if (next.kind === 'refuse' && !wasRefusing) await close();
      if (next.kind !== 'refuse' && wasRefusing) await listen(port);
    },
    inFlight: () => inFlight,
  };
}

/** Calls that arrived in [from, to) and were not answered 200 (answered an error, hung, or cut). */
export function failedCallsBetween(calls: readonly OutageCall[], from: number, to: number): OutageCall[] {
  return calls.filter((call) => call.arrivedAt >= from && call.arrivedAt < to && call.status !== 200);
}

/** The most calls under way at once among these (a call still open counts until `now`). */
export function peakOverlap(calls: readonly OutageCall[], now = Date.now()): number {
  const edges = calls.flatMap((call) => [
    { at: call.arrivedAt, step: 1 },
    { at: call.endedAt ?? now, step: -1 },
  ]);
  // An end and a start at the same millisecond do not overlap.
  edges.sort((a, b) => a.at - b.at || a.step - b.step);
  let current = 0;
  let peak = 0;
  for (const edge of edges) {
    current += edge.step;
    peak = Math.max(peak, current);
  }
  return peak;
}
