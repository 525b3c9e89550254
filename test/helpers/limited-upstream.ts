// A real OpenAI-compatible server on loopback that enforces limits of its own, as providers do:
// a token bucket of requests_per_minute (one second's worth of calls, refilled continuously) and
// at most max_concurrent calls at once. Beyond either it answers 429 with retry-after. Every
// call is recorded: when it arrived, which project's request it carried (the test puts the
// project in the message), whether it was refused, and when it was answered.
import http from 'node:http';
import { listenOnLoopback } from './ports.ts';
import { completionFor } from './upstream.ts';
import type { Teardown } from './teardown.ts';

export interface Limits {
  requestsPerMinute?: number;
  maxConcurrent?: number;
}

export interface UpstreamCall {
  /** performance.now() when it arrived, and when it was answered (or its client went away). */
  arrivedAt: number;
  answeredAt: number | undefined;
  /** The last message's content, as sent. */
  content: string;
  status: number | undefined;
}

export interface LimitedUpstream {
  baseUrl: string;
  calls: UpstreamCall[];
  /** Calls answered 429 so far, and why. */
  refused: { rate: number; concurrency: number; told: number };
  peakInFlight(): number;
  /** The next call is answered 429 with this retry-after (seconds), whatever the limits say. */
  refuseNext(retryAfterSeconds: number): void;
}

export async function startLimitedUpstream(
  t: Teardown,
  options: { limits?: Limits; delayMs?: number } = {},
): Promise<LimitedUpstream> {
  const { requestsPerMinute, maxConcurrent } = options.limits ?? {};
  const rate = requestsPerMinute === undefined ? undefined : requestsPerMinute / 60_000; // per ms
  const capacity = rate === undefined ? 0 : Math.max(1, rate * 1000);
  let level = capacity;
  let refilledAt = performance.now();
  let inFlight = 0;
  let peak = 0;
  const told: number[] = [];
  const calls: UpstreamCall[] = [];
  const refused = { rate: 0, concurrency: 0, told: 0 };

  const server = http.createServer(async (request, response) => {
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    const arrivedAt = performance.now();
    if (request.method !== 'POST' || request.url !== '/v1/chat/completions') {
      response.writeHead(404).end();
      return;
    }
    const body = JSON.parse(Buffer.concat(chunks).toString('utf8'));
    const call: UpstreamCall = { arrivedAt, answeredAt: undefined, content: body.messages?.at(-1)?.content ?? '', status: undefined };
    calls.push(call);
    const answer = (status: number, json: unknown, headers: Record<string, string> = {}) => {
      call.status = status;
      call.answeredAt = performance.now();
      response.writeHead(status, { 'content-type': 'application/json', ...headers });
      response.end(JSON.stringify(json));
    };
    const tooMany = (retryAfter: number) =>
      answer(429, { error: { message: 'Rate limit reached', type: 'requests', code: 'rate_limit_exceeded' } }, { 'retry-after': String(retryAfter) });

    if (told.length > 0) {
      refused.told++;
      tooMany(told.shift()!);
      return;
    }
    if (rate !== undefined) {
      level = Math.min(capacity, level + (arrivedAt - refilledAt) * rate);
      refilledAt = arrivedAt;
      if (level < 1) {
        refused.rate++;
        tooMany(Math.max(1, Math.ceil((1 - level) / rate / 1000)));
        return;
      }
      level -= 1;
    }
    if (maxConcurrent !== undefined && inFlight >= maxConcurrent) {
      refused.concurrency++;
      tooMany(1);
      return;
    }
    inFlight++;
    peak = Math.max(peak, inFlight);
    let ended = false;
    const end = () => {
      if (ended) return;
      ended = true;
      inFlight--;
      call.answeredAt ??= performance.now();
    };
    response.on('close', end);
    if (options.delayMs) await new Promise((resolve) => setTimeout(resolve, options.delayMs));
    if (!response.destroyed) answer(200, completionFor(body));
    end();
  });
  const port = await listenOnLoopback(t, server);
  return {
    baseUrl: `http://127.0.0.1:${port}/v1`,
    calls,
    refused,
    peakInFlight: () => peak,
    refuseNext: (retryAfterSeconds) => told.push(retryAfterSeconds),
  };
}
