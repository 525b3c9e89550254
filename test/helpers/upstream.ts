// A real OpenAI-compatible server on loopback, scripted by the test: each call to
// POST /v1/chat/completions is answered by `reply`, which may also hang, drop the socket, or send
// the headers and the start of a body and hold the rest.
import http from 'node:http';
import { listenOnLoopback } from './ports.ts';
import type { Teardown } from './teardown.ts';

export interface ReceivedCall {
  count: number;
  headers: http.IncomingHttpHeaders;
  body: any;
  /** Date.now() when the call's connection closed, once it has (a call left hanging shows when its client gave up). */
  closedAt?: number;
}

export type Reply =
  | { status: number; json?: unknown; text?: string; headers?: Record<string, string>; hold?: true }
  | { hang: true }
  | { reset: true };

export interface FakeUpstream {
  baseUrl: string;
  calls: ReceivedCall[];
}

export async function startFakeUpstream(
  t: Teardown,
  reply: (call: ReceivedCall) => Reply | Promise<Reply> = (call) => ({ status: 200, json: completionFor(call.body) }),
): Promise<FakeUpstream> {
  const calls: ReceivedCall[] = [];
  const server = http.createServer(async (request, response) => {
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    if (request.method !== 'POST' || request.url !== '/v1/chat/completions') {
      response.writeHead(404).end();
      return;
    }
    const text = Buffer.concat(chunks).toString('utf8');
    const call: ReceivedCall = { count: calls.length + 1, headers: request.headers, body: JSON.parse(text) };
    calls.push(call);
    response.once('close', () => (call.closedAt = Date.now()));
    const answer = await reply(call);
    if ('hang' in answer) return; // never answers; the gateway's timeout must end it
    if ('reset' in answer) {
      request.socket.destroy();
      return;
    }
    const body = answer.text ?? JSON.stringify(answer.json ?? {});
    response.writeHead(answer.status, { 'content-type': 'application/json', ...answer.headers });
    // hold: the body sent so far and never ended (its content-length, if given, never reached).
    if (answer.hold) response.write(body);
    else response.end(body);
  });
  const port = await listenOnLoopback(t, server);
  return { baseUrl: `http://127.0.0.1:${port}/v1`, calls };
}

/** A well-formed chat completion answering the last message. */
export function completionFor(body: { model?: string; messages?: { content: string }[] }) {
  return {
    id: `chatcmpl-fake${Math.random().toString(36).slice(2)}`,
    object: 'chat.completion',
    created: Math.floor(Date.now() / 1000),
    model: body.model ?? 'fake',
    choices: [
      {
        index: 0,
        message: { role: 'assistant', content: `echo: ${body.messages?.at(-1)?.content ?? ''}` },
        finish_reason: 'stop',
      },
    ],
    usage: { prompt_tokens: 3, completion_tokens: 3, total_tokens: 6 },
  };
}
