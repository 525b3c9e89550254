// The two ways load is offered:
//   closed loop: N keep-alive connections, each sending its next request as soon as the last is
//     answered, for saturation figures (throughput, and latency at that throughput);
//   open loop: requests sent on a fixed schedule whatever the answers, for latency at a given
//     rate (a slow answer does not delay the requests after it).
// Both run a warm-up first and then measure a fixed window; only answers that arrive inside the
// window (closed loop) or requests scheduled inside it (open loop) count. Every answer is
// checked, and each kind of wrong answer is counted by name.
import { setTimeout as sleep } from 'node:timers/promises';
import { HttpConnection, type HttpResponse } from './http.ts';
import { increment, PerSecond, Samples } from './stats.ts';

/** Returns undefined for a correct answer, or a short name of what is wrong with it. */
export type Check = (response: HttpResponse) => string | undefined;

export interface WindowHooks {
  /** Called when the measured window opens and closes (after the warm-up; before the drain). */
  onWindowStart?(): void;
  onWindowEnd?(): void;
}

export interface LoadResult {
  windowMs: number;
  /** Correct answers counted in the window. */
  ok: number;
  /** Wrong answers and failed requests in the window, by kind. */
  errors: Map<string, number>;
  /** Over the whole run, warm-up included. */
  totalOk: number;
  totalErrors: number;
  /** Milliseconds from the request's write to the response's last byte, correct answers in the window. */
  latency: Samples;
  /** Correct answers in each whole second of the window, and the lowest and highest of them. */
  perSecond: { min: number; max: number; series: number[] };
}

export interface ClosedLoopOptions extends WindowHooks {
  port: number;
  connections: number;
  warmupMs: number;
  durationMs: number;
  /** The next request, complete and signed. */
  request(): string;
  check: Check;
  /** Every correct answer, warm-up included (e.g. to collect ids). */
  onOk?(response: HttpResponse): void;
  /** Stop after sending this many requests (and receiving their answers), if that comes first. */
  maxRequests?: number;
  /** Called before each request; a promise it returns holds the request back until it settles. */
  gate?(): Promise<void> | undefined;
}

export async function closedLoop(options: ClosedLoopOptions): Promise<LoadResult> {
  const start = performance.now();
  const windowStart = start + options.warmupMs;
  const windowEnd = windowStart + options.durationMs;
  const result = emptyResult(options.durationMs);
  const perSecond = new PerSecond(windowStart);
  const windowTimers = hookTimers(options, windowStart - start, windowEnd - start);

  let sent = 0;
  const limit = options.maxRequests ?? Infinity;
  const loop = async () => {
    let connection: HttpConnection | undefined;
    while (performance.now() < windowEnd && sent < limit) {
      const held = options.gate?.();
      if (held) {
        await held;
        continue;
      }
      sent++;
      try {
        connection ??= await HttpConnection.connect(options.port);
        const response = await connection.send(options.request());
        const problem = options.check(response);
        record(result, problem, response, windowStart, windowEnd, perSecond);
        if (problem === undefined) options.onOk?.(response);
      } catch (error) {
        recordFailure(result, error, performance.now(), windowStart, windowEnd);
        connection?.close();
        connection = undefined;
        // A refused connection would otherwise spin: the gateway may be down.
        await sleep(20);
      }
      if (connection?.closed) connection = undefined;
    }
    connection?.close();
  };
  await Promise.all(Array.from({ length: options.connections }, loop));
  windowTimers.finish();
  result.perSecond = perSecond.range(Math.floor(options.durationMs / 1000));
  return result;
}

export interface OpenLoopOptions extends WindowHooks {
  port: number;
  /** Requests per second. */
  rate: number;
  warmupMs: number;
  durationMs: number;
  /** Connections opened before the first request (more are opened when all are busy). */
  initialConnections: number;
  request(): string;
  check: Check;
  /** How long to wait, after the last request was sent, for the last answers. */
  drainTimeoutMs: number;
}

export interface OpenLoopResult extends LoadResult {
  /** How late requests were written compared with their schedule (ms), requests of the window. */
  sendLag: Samples;
  /** Connections used in all. */
  connections: number;
}

// A keep-alive connection idle for longer than this might be closed by the server (its
// keep-alive timeout is 5 s) just as a request is written on it: it is dropped instead.
const MAX_IDLE_MS = 4_000;

export async function openLoop(options: OpenLoopOptions): Promise<OpenLoopResult> {
  const idle: HttpConnection[] = await Promise.all(
    Array.from({ length: options.initialConnections }, () => HttpConnection.connect(options.port)),
  );
  let opened = idle.length;
  const interval = 1000 / options.rate;
  const start = performance.now() + 5;
  const windowStart = start + options.warmupMs;
  const windowEnd = windowStart + options.durationMs;
  const result: OpenLoopResult = { ...emptyResult(options.durationMs), sendLag: new Samples(), connections: 0 };
  const perSecond = new PerSecond(windowStart);
  const inFlight = new Set<Promise<void>>();
  const windowTimers = hookTimers(options, windowStart - performance.now(), windowEnd - performance.now());

  const connection = async (): Promise<HttpConnection> => {
    for (let candidate = idle.pop(); candidate; candidate = idle.pop()) {
      if (!candidate.closed && performance.now() - candidate.lastUsedAt < MAX_IDLE_MS) return candidate;
      candidate.close();
    }
    opened++;
    return HttpConnection.connect(options.port);
  };

  const dispatch = async (scheduledAt: number) => {
    const counted = scheduledAt >= windowStart && scheduledAt < windowEnd;
    let used: HttpConnection | undefined;
    try {
      used = await connection();
      const response = await used.send(options.request());
      if (counted) result.sendLag.add(response.sentAt - scheduledAt);
      // Counted by schedule, not by arrival: each request of the window is one sample. The
      // per-second counts are of arrivals (warm-up requests included) inside the window.
      const problem = options.check(response);
      record(result, problem, response, -Infinity, Infinity, perSecond, counted);
      if (problem === undefined && !counted) perSecond.add(response.receivedAt);
      idle.push(used);
    } catch (error) {
      used?.close();
      recordFailure(result, error, performance.now(), -Infinity, Infinity, counted);
    }
  };

  let next = start;
  await new Promise<void>((resolve) => {
    const tick = () => {
      const now = performance.now();
      while (next <= now && next < windowEnd) {
        const sending = dispatch(next).finally(() => inFlight.delete(sending));
        inFlight.add(sending);
        next += interval;
      }
      if (next >= windowEnd) resolve();
      else setTimeout(tick, Math.max(0, next - performance.now()));
    };
    setTimeout(tick, Math.max(0, start - performance.now()));
  });
  const drained = Promise.all(inFlight).then(() => true);
  if (!(await Promise.race([drained, sleep(options.drainTimeoutMs, false, { ref: false })]))) {
    increment(result.errors, `no answer within ${options.drainTimeoutMs} ms`, inFlight.size);
  }
  windowTimers.finish();
  for (const spare of idle) spare.close();
  result.connections = opened;
  result.perSecond = perSecond.range(Math.floor(options.durationMs / 1000));
  return result;
}

function emptyResult(windowMs: number): LoadResult {
  return {
    windowMs,
    ok: 0,
    errors: new Map(),
    totalOk: 0,
    totalErrors: 0,
    latency: new Samples(),
    perSecond: { min: 0, max: 0, series: [] },
  };
}

function record(
  result: LoadResult,
  problem: string | undefined,
  response: HttpResponse,
  windowStart: number,
  windowEnd: number,
  perSecond: PerSecond,
  counted = response.receivedAt >= windowStart && response.receivedAt < windowEnd,
): void {
  if (problem === undefined) result.totalOk++;
  else result.totalErrors++;
  if (!counted) return;
  if (problem === undefined) {
    result.ok++;
    result.latency.add(response.receivedAt - response.sentAt);
    perSecond.add(response.receivedAt);
  } else {
    increment(result.errors, problem);
  }
}

function recordFailure(
  result: LoadResult,
  error: unknown,
  at: number,
  windowStart: number,
  windowEnd: number,
  counted = at >= windowStart && at < windowEnd,
): void {
  result.totalErrors++;
  if (counted) increment(result.errors, `request failed: ${(error as Error).message}`);
}

/**
 * Calls the window hooks on time. finish() ends it early: the end hook runs then if the start
 * hook ran, and neither runs later.
 */
function hookTimers(hooks: WindowHooks, startInMs: number, endInMs: number): { finish(): void } {
  let started = false;
  let ended = false;
  const end = () => {
    if (started && !ended) hooks.onWindowEnd?.();
    ended = true;
  };
  const startTimer = setTimeout(() => {
    started = true;
    hooks.onWindowStart?.();
  }, Math.max(0, startInMs));
  const endTimer = setTimeout(end, Math.max(0, endInMs));
  return {
    finish() {
      clearTimeout(startTimer);
      clearTimeout(endTimer);
      end();
    },
  };
}

/** Answer checks, cheap enough to run on every response (no JSON parsing). */
export const checks = {
  status(expected: number, ...mustContain: string[]): Check {
    const needles = mustContain.map((text) => Buffer.from(text));
    return (response) => {
      if (response.status !== expected) return `HTTP ${response.status}${errorCode(response)}`;
      for (const needle of needles) if (!response.body.includes(needle)) return `HTTP ${expected} without ${needle.toString()}`;
      return undefined;
    };
  },
};

function errorCode(response: HttpResponse): string {
  const code = /"code":"([a-z_]+)"/.exec(response.body.toString('utf8', 0, 400))?.[1];
  const object = /"object":"([a-z_.]+)"/.exec(response.body.toString('utf8', 0, 400))?.[1];
  return code ? ` ${code}` : object ? ` ${object}` : '';
}
