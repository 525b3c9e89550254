// The parts of the noisy-neighbour scenario (8-noisy-neighbour.test.ts). Each runs in a thread
// of its own, so that one's work never delays another's clock:
//   provider  a loopback OpenAI-compatible upstream that answers each call ~200 ms after its
//             body has arrived (B's live model, A's large prompts on it, A's invented models);
//   tenant    project B: steady wait=true traffic, live and test, on an open-loop schedule, and
//             its webhook receiver (verifying each delivery with standardwebhooks);
//   attacker  project A: every attack at its own steady rate, and its webhook endpoint, a
//             loopback server that accepts connections and never answers.
// The test's main thread keeps the gateway's processes (and their logs), and samples the
// machine: the CPU of each process and thread, Postgres's activity and WAL, the gateway's
// metrics. Each thread measures its own CPU and event-loop delay per phase.
//
// This file is both: imported by the test, and, in a worker thread, the thread's body.
import { createHash, createHmac, createSecretKey, randomBytes, type KeyObject } from 'node:crypto';
import { readdirSync, readFileSync } from 'node:fs';
import http from 'node:http';
import type { AddressInfo, Socket } from 'node:net';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import { isMainThread, parentPort, Worker, workerData } from 'node:worker_threads';
import type pg from 'pg';
import { Agent, request } from 'undici';
import { DISK_LOOK_MS, DiskWaitTally, processesWaitingOnDisk, type DiskWaitFigures } from '../../../scripts/disk-waits.ts';
import { stringToSign } from '../../../src/client/signing.ts';
import { newApiKey, randomBase62, REQUEST_ID } from '../../../src/ids.ts';
import type { CreatedKey } from '../../../src/keys/service.ts';
import { parseMetrics } from '../../helpers/metrics.ts';
import { childExecArgv } from '../../helpers/node-child.ts';
import { call } from './client.ts';
import { errorShapeProblem, preview } from './contract.ts';
import { CONTENT_MARKER, privateContent } from './run.ts';
import { startWebhookReceiver, type WebhookReceiver } from './webhook-receiver.ts';

// ---------------------------------------------------------------------------------------------
// Shared by every thread: the phases, and what each thread measures of itself.

export const PHASES = ['warmup', 'baseline', 'attack', 'after'] as const;
export type Phase = (typeof PHASES)[number];

/** When each phase begins (Date.now() values); `endAt` ends the last. */
export interface Schedule {
  warmupAt: number;
  baselineAt: number;
  attackAt: number;
  afterAt: number;
  endAt: number;
}

export function phaseAt(schedule: Schedule, at: number): Phase | undefined {
  if (at < schedule.warmupAt || at >= schedule.endAt) return undefined;
  if (at < schedule.baselineAt) return 'warmup';
  if (at < schedule.attackAt) return 'baseline';
  if (at < schedule.afterAt) return 'attack';
  return 'after';
}

/** A thread's own CPU and event-loop delay over one phase. */
export interface ThreadPhase {
  cpuMs: number;
  seconds: number;
  eventLoopP99Ms: number;
  eventLoopMaxMs: number;
}

/** Measures the calling thread phase by phase, from its start to the schedule's end. */
export class ThreadMeter {
  readonly phases: Partial<Record<Phase, ThreadPhase>> = {};
  readonly #delay = monitorEventLoopDelay({ resolution: 1 });
  #cpu = process.threadCpuUsage();
  #at = Date.now();
  readonly #timers: NodeJS.Timeout[] = [];

  constructor(schedule: Schedule) {
    this.#delay.enable();
    const boundaries = [schedule.warmupAt, schedule.baselineAt, schedule.attackAt, schedule.afterAt, schedule.endAt];
    boundaries.forEach((at, index) => {
      this.#timers.push(setTimeout(() => this.#close(index === 0 ? undefined : PHASES[index - 1]), Math.max(0, at - Date.now())));
    });
  }

  #close(phase: Phase | undefined): void {
    const cpu = process.threadCpuUsage(this.#cpu);
    const now = Date.now();
    if (phase) {
      this.phases[phase] = {
        cpuMs: (cpu.user + cpu.system) / 1000,
        seconds: (now - this.#at) / 1000,
        eventLoopP99Ms: this.#delay.count ? this.#delay.percentile(99) / 1e6 : 0,
        eventLoopMaxMs: this.#delay.count ? this.#delay.max / 1e6 : 0,
      };
    }
    this.#cpu = process.threadCpuUsage();
    this.#at = now;
    this.#delay.reset();
  }

  stop(): void {
    for (const timer of this.#timers) clearTimeout(timer);
    this.#delay.disable();
  }
}

const sleepUntil = (at: number) => sleep(Math.max(0, at - Date.now()));

/** The nearest-rank percentile of some numbers (undefined for none). */
export function percentile(values: readonly number[], q: number): number | undefined {
  if (values.length === 0) return undefined;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))];
}

/** Counts of each value. */
export function countBy<T>(values: Iterable<T>, key: (value: T) => string): Record<string, number> {
  const counts: Record<string, number> = {};
  for (const value of values) {
    const name = key(value);
    counts[name] = (counts[name] ?? 0) + 1;
  }
  return counts;
}

export const formatCounts = (counts: Record<string, number>): string =>
  Object.entries(counts)
    .sort(([a], [b]) => (a < b ? -1 : 1))
    .map(([name, count]) => `${name}: ${count}`)
    .join(', ') || 'none';

// ---------------------------------------------------------------------------------------------
// Threads: started from the main thread, driven by messages ({ id, kind, payload } and a reply
// with the same id).

type Role = 'provider' | 'tenant' | 'attacker';

export class NeighbourThread {
  readonly role: Role;
  readonly #worker: Worker;
  readonly #pending = new Map<number, { resolve(value: any): void; reject(error: Error): void }>();
  #next = 1;
  #exited: Error | undefined;

  private constructor(role: Role, worker: Worker) {
    this.role = role;
    this.#worker = worker;
    worker.on('message', (message: { id: number; result?: unknown; error?: string }) => {
      const pending = this.#pending.get(message.id);
      this.#pending.delete(message.id);
      if (message.error !== undefined) pending?.reject(new Error(`${role} thread: ${message.error}`));
      else pending?.resolve(message.result);
    });
    const fail = (error: Error) => {
      this.#exited = error;
      for (const pending of this.#pending.values()) pending.reject(error);
      this.#pending.clear();
    };
    worker.on('error', fail);
    worker.on('exit', (code) => fail(new Error(`${role} thread exited (${code})`)));
  }

  static start(role: Role, t: { teardown(fn: () => Promise<void> | void): void }): NeighbourThread {
    // Without tap's own loaders (process info, mocks): a thread is not a test.
    const worker = new Worker(new URL(import.meta.url), { workerData: { neighbourRole: role }, execArgv: childExecArgv() });
    const thread = new NeighbourThread(role, worker);
    t.teardown(async () => {
      await thread.ask('close').catch(() => undefined);
      await worker.terminate();
    });
    return thread;
  }

  ask<T = any>(kind: string, payload?: unknown): Promise<T> {
    if (this.#exited) return Promise.reject(this.#exited);
    const id = this.#next++;
    return new Promise<T>((resolve, reject) => {
      this.#pending.set(id, { resolve, reject });
      this.#worker.postMessage({ id, kind, payload });
    });
  }
}

/** In a thread: answers each message with what `handlers[kind]` returns. */
function serve(handlers: Record<string, (payload: any) => unknown>): void {
  parentPort!.on('message', async (message: { id: number; kind: string; payload: unknown }) => {
    try {
      const handler = handlers[message.kind];
      if (!handler) throw new Error(`no handler for ${message.kind}`);
      parentPort!.postMessage({ id: message.id, result: await handler(message.payload) });
    } catch (error) {
      parentPort!.postMessage({ id: message.id, error: String((error as Error)?.stack ?? error) });
    }
  });
}

/** The teardown list of a thread: run by its "close" message. */
function teardowns() {
  const list: (() => Promise<void> | void)[] = [];
  return {
    t: { teardown: (fn: () => Promise<void> | void) => void list.push(fn) },
    close: async () => {
      for (const fn of list.reverse()) await fn();
      list.length = 0;
    },
  };
}

// ---------------------------------------------------------------------------------------------
// The provider: one OpenAI-compatible upstream for every live model of the scenario.

/** Bodies above this are not parsed (a provider reads them, the test only counts them). */
const PARSED_BODY_BYTES = 64 * 1024;

export interface ProviderStats {
  /** Calls by kind: the shared model's small and large bodies, and pattern-served (invented) models. */
  calls: Record<string, number>;
  megabytes: number;
  meter: ThreadMeter['phases'];
}

function providerThread(): void {
  const { t, close } = teardowns();
  const calls: Record<string, number> = {};
  let bytesReceived = 0;
  let meter: ThreadMeter | undefined;
  let delayMs = 200;
  let sharedModel = '';
  serve({
    async start(payload: { delayMs: number; sharedModel: string }) {
      delayMs = payload.delayMs;
      sharedModel = payload.sharedModel;
      const server = http.createServer(async (incoming, response) => {
        const chunks: Buffer[] = [];
        let bytes = 0;
        for await (const chunk of incoming) {
          chunks.push(chunk as Buffer);
          bytes += (chunk as Buffer).length;
        }
        bytesReceived += bytes;
        if (incoming.method !== 'POST' || incoming.url !== '/v1/chat/completions') {
          response.writeHead(404).end();
          return;
        }
        const whole = Buffer.concat(chunks);
        const model = /"model"\s*:\s*"([^"]*)"/.exec(whole.subarray(0, 512).toString('utf8'))?.[1] ?? 'unknown';
        let content = 'ok';
        if (bytes <= PARSED_BODY_BYTES) {
          const body = JSON.parse(whole.toString('utf8')) as { messages?: { content?: string }[] };
          content = `echo: ${body.messages?.at(-1)?.content ?? ''}`;
        }
        const kind = model === sharedModel ? (bytes > PARSED_BODY_BYTES ? 'shared model, large' : 'shared model') : 'pattern-served model';
        calls[kind] = (calls[kind] ?? 0) + 1;
        await sleep(delayMs);
        // Usage as a provider would count it, roughly: a token per 4 bytes of prompt.
        const promptTokens = Math.ceil(bytes / 4);
        response.writeHead(200, { 'content-type': 'application/json' }).end(
          JSON.stringify({
            id: `chatcmpl-${randomBase62(24)}`,
            object: 'chat.completion',
            created: Math.floor(Date.now() / 1000),
            model,
            choices: [{ index: 0, message: { role: 'assistant', content }, finish_reason: 'stop' }],
            usage: { prompt_tokens: promptTokens, completion_tokens: 3, total_tokens: promptTokens + 3 },
          }),
        );
      });
      server.keepAliveTimeout = 30_000;
      await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
      t.teardown(() => new Promise<void>((resolve) => {
        server.closeAllConnections();
        server.close(() => resolve());
      }));
      return { baseUrl: `http://127.0.0.1:${(server.address() as AddressInfo).port}/v1` };
    },
    measure(schedule: Schedule) {
      meter = new ThreadMeter(schedule);
    },
    stats(): ProviderStats {
      meter?.stop();
      return { calls, megabytes: bytesReceived / 1e6, meter: meter?.phases ?? {} };
    },
    close,
  });
}

// ---------------------------------------------------------------------------------------------
// Tenant B: steady wait=true traffic and a webhook receiver.

export interface TenantStream {
  mode: 'live' | 'test';
  key: CreatedKey;
  model: string;
  /** Requests a second, sent on a fixed schedule whatever the answers (open loop). */
  rate: number;
}

export interface TenantCall {
  mode: 'live' | 'test';
  phase: Phase;
  sentAt: number;
  ms: number;
  status: number;
  /** Answered 200 with a chat completion. */
  completed: boolean;
  /** What it was, when it was not a completion: the error code, the status of an acknowledgement, or why no answer came. */
  detail: string | undefined;
  /** Its message's content (unique), to find its row. */
  content: string;
}

export interface TenantDelivery {
  id: string;
  receivedAt: number;
  verified: boolean;
  type: string | undefined;
  requestId: string | undefined;
}

function tenantThread(): void {
  const { t, close } = teardowns();
  let receiver: WebhookReceiver | undefined;
  serve({
    async start() {
      receiver = await startWebhookReceiver(t);
      return { url: receiver.url };
    },
    secret(secret: string) {
      receiver!.secret = secret;
    },
    async run(payload: { apiUrl: string; schedule: Schedule; streams: TenantStream[]; timeoutMs: number }) {
      const { apiUrl, schedule, streams, timeoutMs } = payload;
      const meter = new ThreadMeter(schedule);
      const calls: Promise<TenantCall | undefined>[] = [];
      await Promise.all(
        streams.map(async (stream, index) => {
          // The streams interleave: each starts a fraction of its interval after the one before.
          const interval = 1000 / stream.rate;
          const offset = (interval * index) / streams.length;
          for (let i = 0; ; i++) {
            const due = schedule.warmupAt + offset + i * interval;
            if (due >= schedule.endAt) break;
            await sleepUntil(due);
            const content = privateContent(`scenario 8 tenant B ${stream.mode} ${i}`);
            calls.push(
              call(apiUrl, {
                path: '/v1/chat/completions',
                key: stream.key,
                timeoutMs,
                body: { model: stream.model, messages: [{ role: 'user', content }], wait: true },
              }).then((answer) => {
                const phase = phaseAt(schedule, answer.sentAt);
                if (!phase) return undefined;
                const completed = answer.status === 200 && answer.body?.object === 'chat.completion';
                return {
                  mode: stream.mode,
                  phase,
                  sentAt: answer.sentAt,
                  ms: answer.answeredAt - answer.sentAt,
                  status: answer.status,
                  completed,
                  detail: completed
                    ? undefined
                    : answer.status === 0
                      ? answer.failure
                      : answer.body?.error
                        ? `${answer.body.error.code} (${preview(answer.body.error.message, 120)})`
                        : (answer.body?.status ?? preview(answer.body, 80)),
                  content,
                };
              }),
            );
          }
        }),
      );
      const answered = (await Promise.all(calls)).filter((answer): answer is TenantCall => answer !== undefined);
      await sleepUntil(schedule.endAt);
      meter.stop();
      return { calls: answered, meter: meter.phases };
    },
    deliveries(): TenantDelivery[] {
      return (receiver?.deliveries ?? []).map((delivery) => ({
        id: delivery.id,
        receivedAt: delivery.receivedAt,
        verified: delivery.verified,
        type: delivery.event?.type,
        requestId: delivery.event?.data.id,
      }));
    },
    close,
  });
}

// ---------------------------------------------------------------------------------------------
// Tenant A: the attacks.

export const ATTACKS = ['big-prompts', 'test-429', 'invented-models', 'webhook-hang', 'unauthenticated'] as const;
export type Attack = (typeof ATTACKS)[number];

/** What each attack sends, a second. */
export const ATTACK_RATES: Record<Attack, number> = {
  'big-prompts': 10,
  'test-429': 100,
  'invented-models': 400,
  'webhook-hang': 150,
  // A third each: keys with a wrong checksum, made-up keys whose checksum matches (anyone can
  // compute one: the gateway must read those), and GET /readyz.
  unauthenticated: 300,
};

/** Requests of one attack that may wait for their answers at once; beyond, a send is skipped (and counted). */
const OUTSTANDING: Record<Attack, number> = {
  'big-prompts': 40,
  'test-429': 1_000,
  'invented-models': 2_000,
  'webhook-hang': 1_000,
  unauthenticated: 2_000,
};

export const BIG_PROMPT_BYTES = 3_000_000;

export interface AttackPlan {
  apiUrl: string;
  schedule: Schedule;
  attacks: Attack[];
  /** The key of each attack that authenticates (all but "unauthenticated"). */
  keys: Partial<Record<Attack, CreatedKey>>;
  /** The live model B uses: the big prompts go to it. */
  sharedModel: string;
  /** Connections A's client opens to the API at most (its requests beyond wait for one, in A's client). */
  connections: number;
}

export interface AttackReport {
  attack: Attack;
  sent: number;
  /** Sends skipped because OUTSTANDING answers were still awaited. */
  skipped: number;
  /** Answers by "status code" (202 accepted, 401 invalid_api_key, 200 ready, ...); "no answer: ..." for none. */
  answers: Record<string, number>;
  /** Answers not in the contract (wrong shape, unexpected status, a 5xx other than a 503 busy). */
  problems: string[];
  problemCount: number;
  /** Ids of the requests it was told were accepted (202). */
  acceptedIds: string[];
  /** The invented models of accepted requests. */
  acceptedModels: string[];
  latencyMs: { p50: number | undefined; p99: number | undefined; max: number | undefined };
}

interface Outgoing {
  method: 'GET' | 'POST';
  path: string;
  headers: Record<string, string>;
  body: Buffer | undefined;
  /** What a good answer is for this request. */
  expect: 'submission' | 'unauthenticated' | 'readyz';
  model?: string;
}

/** Signs like docs/signing.md, the body's SHA-256 given. */
class Signer {
  readonly #key: CreatedKey;
  readonly #secret: KeyObject;
  readonly #prefix = `n${randomBytes(9).toString('base64url')}`;
  #counter = 0;

  constructor(key: CreatedKey) {
    this.#key = key;
    this.#secret = createSecretKey(Buffer.from(key.signing_secret, 'utf8'));
  }

  post(path: string, body: Buffer, bodySha256: string): Pick<Outgoing, 'method' | 'path' | 'headers' | 'body'> {
    const timestamp = Math.floor(Date.now() / 1000);
    const nonce = `${this.#prefix}_${(this.#counter++).toString(36).padStart(6, '0')}`;
    const hmac = createHmac('sha256', this.#secret)
      .update(stringToSign({ timestamp, nonce, method: 'POST', path, bodySha256 }))
      .digest('hex');
    return {
      method: 'POST',
      path,
      body,
      headers: {
        authorization: `Bearer ${this.#key.api_key}`,
        'svc-signature': `t=${timestamp},n=${nonce},v1=${hmac}`,
        'content-type': 'application/json',
      },
    };
  }
}

const sha256 = (bytes: Buffer) => createHash('sha256').update(bytes).digest('hex');
const jsonBody = (value: unknown) => Buffer.from(JSON.stringify(value), 'utf8');

/** The next request of an attack. */
function attackSource(attack: Attack, plan: AttackPlan): () => Outgoing {
  const path = '/v1/chat/completions';
  const signer = plan.keys[attack] && new Signer(plan.keys[attack]!);
  switch (attack) {
    case 'big-prompts': {
      // A few 3 MB bodies, made once, each sent again and again (a new nonce each time): random
      // text, which Postgres cannot compress. The model comes first, as a client writes it.
      const bodies = Array.from({ length: 4 }, (_, i) => {
        const filler = randomBytes((BIG_PROMPT_BYTES * 3) / 4).toString('base64url');
        const body = jsonBody({ model: plan.sharedModel, messages: [{ role: 'user', content: `${CONTENT_MARKER} big prompt ${i} ${filler}` }] });
        return { body, sha: sha256(body) };
      });
      let i = 0;
      return () => {
        const { body, sha } = bodies[i++ % bodies.length]!;
        return { ...signer!.post(path, body, sha), expect: 'submission' };
      };
    }
    case 'test-429':
    case 'webhook-hang': {
      const model = attack === 'test-429' ? 'test-error-429' : 'test-echo';
      let i = 0;
      return () => {
        const body = jsonBody({ model, messages: [{ role: 'user', content: privateContent(`scenario 8 tenant A ${attack} ${i++}`) }] });
        return { ...signer!.post(path, body, sha256(body)), expect: 'submission' };
      };
    }
    case 'invented-models': {
      let i = 0;
      return () => {
        const model = `invented-${randomBase62(12)}`;
        const body = jsonBody({ model, messages: [{ role: 'user', content: privateContent(`scenario 8 tenant A invented ${i++}`) }] });
        return { ...signer!.post(path, body, sha256(body)), expect: 'submission', model };
      };
    }
    case 'unauthenticated': {
      let i = 0;
      const body = jsonBody({ model: 'gpt-anything', messages: [{ role: 'user', content: 'hello' }] });
      return () => {
        const kind = i++ % 3;
        if (kind === 2) return { method: 'GET', path: '/readyz', headers: {}, body: undefined, expect: 'readyz' };
        // Today's keys: 40 random characters and a 6-character checksum, here wrong (a check of
        // the text refuses them), or right, as anyone can compute it: a made-up key the gateway
        // cannot refuse without reading it.
        const key = kind === 0 ? `svc_live_${randomBase62(46)}` : newApiKey('live');
        return {
          method: 'POST',
          path,
          body,
          headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
          expect: 'unauthenticated',
        };
      };
    }
  }
}

/** What is wrong with an answer to one of A's requests (undefined: nothing). */
function judge(outgoing: Outgoing, status: number, headers: Headers, body: any): string | undefined {
  // 503 is the contract's "busy, retry after" (a full line of key reads or of new models).
  if (status >= 500 && status !== 503) return `HTTP ${status}`;
  if (status >= 400) {
    const problem = errorShapeProblem(status, headers, body);
    if (problem) return problem;
    const code = body?.error?.code;
    const allowed: Record<Outgoing['expect'], string[]> = {
      submission: ['rate_limit_exceeded', 'invalid_parameter', 'service_unavailable'],
      unauthenticated: ['invalid_api_key', 'service_unavailable'],
      readyz: ['service_unavailable'],
    };
    if (!allowed[outgoing.expect].includes(code)) return `HTTP ${status} ${code}, not expected for a ${outgoing.expect} request`;
    return undefined;
  }
  if (outgoing.expect === 'readyz') return status === 200 && body?.status === 'ready' ? undefined : `readyz answered ${status} ${preview(body)}`;
  if (outgoing.expect === 'unauthenticated') return `an unknown key got ${status} ${preview(body)}`;
  if (status !== 202 || body?.object !== 'chat.completion.async' || !REQUEST_ID.test(body?.id ?? '')) {
    return `a submission answered ${status} ${preview(body)}`;
  }
  return undefined;
}

function attackerThread(): void {
  const { t, close } = teardowns();
  let hung = 0;
  serve({
    async start() {
      // A's webhook endpoint: it takes every connection and every request, and never answers.
      const sockets = new Set<Socket>();
      const server = http.createServer(() => {
        hung++;
      });
      server.on('connection', (socket) => {
        sockets.add(socket);
        socket.once('close', () => sockets.delete(socket));
      });
      server.requestTimeout = 0;
      server.headersTimeout = 0;
      await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
      t.teardown(() => new Promise<void>((resolve) => {
        for (const socket of sockets) socket.destroy();
        server.close(() => resolve());
      }));
      return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}/webhooks` };
    },
    async run(plan: AttackPlan) {
      const meter = new ThreadMeter(plan.schedule);
      const agent = new Agent({ keepAliveTimeout: 10_000, connections: plan.connections });
      t.teardown(() => agent.destroy());
      const reports = await Promise.all(plan.attacks.map((attack) => runAttack(attack, plan, agent)));
      await sleepUntil(plan.schedule.endAt);
      meter.stop();
      return { reports, meter: meter.phases, hungRequests: hung };
    },
    close,
  });
}

async function runAttack(attack: Attack, plan: AttackPlan, agent: Agent): Promise<AttackReport> {
  const next = attackSource(attack, plan);
  const rate = ATTACK_RATES[attack];
  const report: AttackReport = {
    attack,
    sent: 0,
    skipped: 0,
    answers: {},
    problems: [],
    problemCount: 0,
    acceptedIds: [],
    acceptedModels: [],
    latencyMs: { p50: undefined, p99: undefined, max: undefined },
  };
  const latencies: number[] = [];
  const inFlight = new Set<Promise<void>>();
  const tally = (label: string) => (report.answers[label] = (report.answers[label] ?? 0) + 1);
  const problem = (text: string) => {
    report.problemCount++;
    if (report.problems.length < 20) report.problems.push(text);
  };
  const send = async (outgoing: Outgoing) => {
    const sentAt = performance.now();
    let status = 0;
    let headers: Headers = new Headers();
    let text = '';
    try {
      const answer = await request(`${plan.apiUrl}${outgoing.path}`, {
        method: outgoing.method,
        headers: outgoing.headers,
        body: outgoing.body ?? null,
        dispatcher: agent,
        headersTimeout: 60_000,
        bodyTimeout: 60_000,
      });
      status = answer.statusCode;
      text = await answer.body.text();
      headers = new Headers();
      for (const [name, value] of Object.entries(answer.headers)) {
        if (typeof value === 'string') headers.set(name, value);
        else if (Array.isArray(value)) headers.set(name, value.join(', '));
      }
    } catch (error) {
      const cause = (error as { code?: string; cause?: { code?: string } }).code ?? (error as { cause?: { code?: string } }).cause?.code;
      tally(`no answer: ${cause ?? (error as Error).message}`);
      problem(`${outgoing.method} ${outgoing.path}: no answer (${cause ?? (error as Error).message})`);
      return;
    }
    latencies.push(performance.now() - sentAt);
    let body: any = text;
    try {
      body = JSON.parse(text);
    } catch {}
    const label = status === 202 ? '202 accepted' : status === 200 && outgoing.expect === 'readyz' ? '200 ready' : `${status} ${body?.error?.code ?? ''}`.trim();
    tally(label);
    const wrong = judge(outgoing, status, headers, body);
    if (wrong) problem(`${outgoing.method} ${outgoing.path}${outgoing.model ? ` (${outgoing.model})` : ''}: ${wrong}`);
    if (status === 202 && typeof body?.id === 'string') {
      report.acceptedIds.push(body.id);
      if (outgoing.model) report.acceptedModels.push(outgoing.model);
    }
  };

  // Open loop: every few milliseconds, as many as are due by now.
  const { attackAt, afterAt } = plan.schedule;
  await sleepUntil(attackAt);
  for (;;) {
    const now = Date.now();
    if (now >= afterAt) break;
    const due = Math.floor(((now - attackAt) * rate) / 1000) + 1;
    while (report.sent + report.skipped < due) {
      if (inFlight.size >= OUTSTANDING[attack]) {
        report.skipped++;
        continue;
      }
      report.sent++;
      const sending = send(next()).finally(() => inFlight.delete(sending));
      inFlight.add(sending);
    }
    await sleep(5);
  }
  await Promise.all(inFlight);
  const sorted = latencies.map(Math.round);
  report.latencyMs = { p50: percentile(sorted, 0.5), p99: percentile(sorted, 0.99), max: percentile(sorted, 1) };
  return report;
}

// ---------------------------------------------------------------------------------------------
// The main thread's samplers.

// /proc counts CPU time in USER_HZ ticks, 100 a second on Linux whatever the kernel's HZ.
const ticksPerSecond = 100;

/** CPU seconds a process has used so far (user + system), from /proc; undefined when it is gone. */
export function processCpuSeconds(pid: number): number | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'latin1');
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return (Number(fields[11]) + Number(fields[12])) / ticksPerSecond;
  } catch {
    return undefined;
  }
}

/** The parent of a process, from /proc (undefined when it cannot be read: another machine's). */
export function parentOf(pid: number): number | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'latin1');
    return Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
  } catch {
    return undefined;
  }
}

/** CPU seconds of a postmaster and all its children (backends, WAL writer, checkpointer, ...). */
export function postgresCpuSeconds(postmaster: number): number {
  let total = processCpuSeconds(postmaster) ?? 0;
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    if (parentOf(Number(entry)) === postmaster) total += processCpuSeconds(Number(entry)) ?? 0;
  }
  return total;
}

/** Busy and total CPU seconds of the whole machine (all cores), from /proc/stat. */
export function machineCpuSeconds(): { busy: number; all: number } {
  const line = readFileSync('/proc/stat', 'latin1').split('\n', 1)[0]!;
  const values = line.trim().split(/\s+/).slice(1, 9).map(Number);
  const all = values.reduce((sum, value) => sum + value, 0);
  return { busy: (all - values[3]! - values[4]!) / ticksPerSecond, all: all / ticksPerSecond };
}

/**
 * How long processes of the machine waited on the disk, phase by phase (../../../scripts/disk-waits.ts
 * says why it matters): a slow WAL flush stalls every commit, in any phase.
 */
export class DiskWaits {
  readonly #schedule: Schedule;
  readonly #tallies = new Map<Phase, DiskWaitTally>();
  readonly #timer: NodeJS.Timeout;
  #phase: Phase | undefined;

  constructor(schedule: Schedule) {
    this.#schedule = schedule;
    this.#timer = setInterval(() => this.#look(), DISK_LOOK_MS);
  }

  #look(): void {
    const waiting = processesWaitingOnDisk();
    if (waiting === undefined) return;
    const now = Date.now();
    const phase = phaseAt(this.#schedule, now);
    if (phase !== this.#phase && this.#phase) this.#tallies.get(this.#phase)!.close(now);
    this.#phase = phase;
    if (!phase) return;
    let tally = this.#tallies.get(phase);
    if (!tally) this.#tallies.set(phase, (tally = new DiskWaitTally()));
    tally.add(now, waiting);
  }

  /** What it saw in `phase` (undefined: it could not look). */
  phase(phase: Phase): DiskWaitFigures | undefined {
    return this.#tallies.get(phase)?.figures();
  }

  stop(): void {
    clearInterval(this.#timer);
    if (this.#phase) this.#tallies.get(this.#phase)!.close(Date.now());
  }
}

/** A process's /metrics, as a map from "name{labels}" to value. */
export async function scrape(url: string): Promise<Map<string, number>> {
  return parseMetrics(await (await fetch(url, { signal: AbortSignal.timeout(5_000) })).text());
}

/** The sum of the series of a metric whose labels include all of `labels`. */
export function metricSum(values: Map<string, number>, name: string, labels: Record<string, string> = {}): number {
  let sum = 0;
  for (const [series, value] of values) {
    const brace = series.indexOf('{');
    const seriesName = brace < 0 ? series : series.slice(0, brace);
    if (seriesName !== name) continue;
    if (Object.entries(labels).every(([label, wanted]) => series.includes(`${label}="${wanted}"`))) sum += value;
  }
  return sum;
}

/** The series of a metric, by the value of one label (summed over the others). */
export function metricBy(values: Map<string, number>, name: string, label: string): Record<string, number> {
  const by: Record<string, number> = {};
  for (const [series, value] of values) {
    if (!series.startsWith(`${name}{`)) continue;
    const match = new RegExp(`${label}="([^"]*)"`).exec(series);
    if (!match) continue;
    by[match[1]!] = (by[match[1]!] ?? 0) + value;
  }
  return by;
}

/**
 * One look at the database's client backends of the gateway: for each that is active or idle in
 * a transaction, "application wait-event" and "application statement" (its first words).
 */
export async function activeBackends(pool: pg.Pool): Promise<{ waits: string[]; statements: string[] }> {
  const { rows } = await pool.query<{ application_name: string; wait: string; statement: string }>(
    `select application_name,
            case when state = 'active' then coalesce(wait_event_type || ':' || wait_event, 'on CPU') else state end as wait,
            left(regexp_replace(query, '\\s+', ' ', 'g'), 60) as statement
     from pg_stat_activity
     where datname = current_database() and state in ('active', 'idle in transaction') and pid <> pg_backend_pid()
       and backend_type = 'client backend' and application_name not like 'faults-%'`,
  );
  return {
    waits: rows.map((row) => `${row.application_name || '(unnamed)'} ${row.wait}`),
    statements: rows.map((row) => `${row.application_name || '(unnamed)'} "${row.statement}"`),
  };
}

/** WAL and checkpoint counters of the whole server, to be compared between two moments. */
export interface WalCounters {
  lsnBytes: number;
  walBuffersFull: number;
  walWrite: number;
  walSync: number;
  checkpoints: number;
}

export async function walCounters(pool: pg.Pool): Promise<WalCounters> {
  const { rows } = await pool.query<{ lsn_bytes: string; wal_buffers_full: string; wal_write: string; wal_sync: string; checkpoints: string }>(
    `select pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint as lsn_bytes,
            w.wal_buffers_full, w.wal_write, w.wal_sync,
            (select checkpoints_timed + checkpoints_req from pg_stat_bgwriter) as checkpoints
     from pg_stat_wal as w`,
  );
  const row = rows[0]!;
  return {
    lsnBytes: Number(row.lsn_bytes),
    walBuffersFull: Number(row.wal_buffers_full),
    walWrite: Number(row.wal_write),
    walSync: Number(row.wal_sync),
    checkpoints: Number(row.checkpoints),
  };
}

// ---------------------------------------------------------------------------------------------
// In a worker thread: the thread's body.

if (!isMainThread && (workerData as { neighbourRole?: Role } | undefined)?.neighbourRole) {
  const role = (workerData as { neighbourRole: Role }).neighbourRole;
  if (role === 'provider') providerThread();
  else if (role === 'tenant') tenantThread();
  else attackerThread();
}
