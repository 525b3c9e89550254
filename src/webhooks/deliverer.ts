// Delivering webhook messages (CONTRACT.md section 13), one try at a time. A deliver_webhook job
// claims its message in one statement and starts the try here, then ends: a try in flight holds
// a socket and a timer, not a graphile-worker slot nor a database connection, as upstream calls
// do (worker/dispatcher.ts), up to WEBHOOK_MAX_IN_FLIGHT per process. The try POSTs the event,
// signed as Standard Webhooks says, and its end is recorded in one statement: delivered on a 2xx;
// a 410 disables the endpoint; anything else, or no answer within WEBHOOK_TIMEOUT_MS, is retried
// after the next wait of WEBHOOK_RETRY_SCHEDULE, until the schedule is spent.
//
// Tries are owned by the process's worker id (the dispatcher's, kept alive by the supervisor's
// heartbeat). If the process dies, its messages stay delivering until the supervisor's sweep
// finds that id gone and hands them back (recoverLost); at shutdown, tries in flight get
// SHUTDOWN_GRACE_MS, then are aborted and retried at once. A try's end is recorded however long
// the database stays unavailable, until the shutdown's grace is over: given up, its message
// would be handed back by the sweep and delivered again.
import { Agent, request } from 'undici';
import { parseRetryAfter } from '../client/retry.ts';
import { signWebhook } from '../client/webhooks.ts';
import type { Config } from '../config.ts';
import { errorSummary, type Db } from '../db/pool.ts';
import { whileUnavailable } from '../db/retry.ts';
import { landWithin, type InFlight } from '../grace.ts';
import { decryptSecret } from '../keys/secrets.ts';
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import { recordJson } from '../requests/record.ts';
import { deliveryConnector, ForbiddenAddressError } from './address.ts';
import {
  addDeliveryJob,
  claimMessage,
  finishTry,
  recoverLostDeliveries,
  type ClaimedMessage,
  type TryEnd,
} from './delivery-repository.ts';

export interface WebhookDelivererOptions {
  db: Db;
  /** secretEncryptionKeys: every key that may decrypt the endpoints' secrets (empty: none set, nothing is sent). */
  config: Pick<Config, 'webhooks' | 'secretEncryptionKeys' | 'shutdownGraceMs'>;
  /** The owner of this process's tries (webhook_messages.worker_id): the dispatcher's workerId. */
  workerId: string;
  metrics: Metrics;
  logger: Logger;
}

/** What deliver() did with a message. */
export type Delivery =
  /** A try is under way. */
  | 'started'
  /** Its endpoint is disabled: the message is abandoned. */
  | 'abandoned'
  /** Nothing to do: not pending or not due (delivered, given up, under way elsewhere, removed). */
  | 'nothing'
  /** No try now (no room, shutting down, no SECRET_ENCRYPTION_KEY): its job is added again for later. */
  | 'deferred';

/** The longest wait before a retry, whatever the schedule or a retry-after says. */
export const MAX_RETRY_WAIT_MS = 24 * 60 * 60 * 1000;
// A process at WEBHOOK_MAX_IN_FLIGHT hands the message back for this much later (another worker
// with room may take it sooner).
const BUSY_RETRY_MS = 1_000;
// Without SECRET_ENCRYPTION_KEY nothing can be signed: messages are looked at again this often.
const NO_KEY_RETRY_MS = 60_000;
// What of a receiver's answer is read (and dropped), so that its connection serves the next try.
const MAX_ANSWER_BYTES = 64 * 1024;
// Idle connections to an endpoint kept for its next tries this long.
const KEEP_ALIVE_MS = 10_000;
// How long a statement other than a try's end is retried while the database is unavailable
// (the deliver_webhook job fails then, and graphile-worker runs it again later).
const OUTAGE_PATIENCE_MS = 60_000;

const ABORTED_BY_SHUTDOWN = 'shutdown';
const ABORTED_BY_TIMEOUT = 'timeout';

/**
 * The wait before the try after try number `tries` failed: that entry of the schedule, ±10 %
 * jitter, never shorter than a retry-after the endpoint sent, at most 24 h; undefined once the
 * schedule is spent.
 */
export function nextTryDelay(
  scheduleMs: readonly number[],
  tries: number,
  retryAfterMs?: number,
  random: () => number = Math.random,
): number | undefined {
  const wait = scheduleMs[tries - 1];
  if (wait === undefined) return undefined;
  const jittered = wait * (0.9 + 0.2 * random());
  return Math.round(Math.min(MAX_RETRY_WAIT_MS, Math.max(jittered, retryAfterMs ?? 0)));
}

/** The body of a delivery: the event, when its request ended, and the request's record. */
export function eventBody(message: Pick<ClaimedMessage, 'event_type' | 'created_at' | 'request'>): string {
  const head = JSON.stringify({ type: message.event_type, timestamp: message.created_at.toISOString() });
  return `${head.slice(0, -1)},"data":${recordJson(message.request)}}`;
}

/** How a try went, before it is recorded. */
type Answer =
  | { kind: 'delivered'; httpStatus: number }
  | { kind: 'gone'; httpStatus: number }
  | { kind: 'failed'; httpStatus: number | null; error: string; retryAfterMs?: number | undefined; retryAtOnce?: boolean };

export class WebhookDeliverer {
  readonly workerId: string;
  readonly #options: WebhookDelivererOptions;
  readonly #log: Logger;
  readonly #agent: Agent;
  /** Tries in flight: each one's abort controller, and the promise of its end. */
  readonly #tries = new Map<AbortController, InFlight>();
  /** Claims under way (each may start a try): counted against the capacity, awaited by stop(). */
  readonly #claims = new Set<Promise<unknown>>();
  #stopping = false;
  /** Aborted once the shutdown's grace is over: tries' ends still unrecorded are given up. */
  readonly #abandoning = new AbortController();
  #stopped: Promise<void> | undefined;
  #toldNoKey = false;

  constructor(options: WebhookDelivererOptions) {
    this.#options = options;
    this.workerId = options.workerId;
    this.#log = options.logger.child({ component: 'webhooks' });
    const { allowPrivate, timeoutMs } = options.config.webhooks;
    this.#agent = new Agent({
      connect: deliveryConnector({ allowPrivate, timeoutMs }),
      keepAliveTimeout: KEEP_ALIVE_MS,
      // The try's own signal bounds it (WEBHOOK_TIMEOUT_MS).
      headersTimeout: 0,
      bodyTimeout: 0,
    });
  }

  /** Tries in flight now. */
  get inFlight(): number {
    return this.#tries.size;
  }

  /**
   * The deliver_webhook job: claims the message and starts its try in the background. Resolves
   * once the try is started (or there is none to make); rejects only if the database stays out
   * of reach, so that graphile-worker runs the job again.
   */
  async deliver(messageId: string): Promise<Delivery> {
    const { db, config } = this.#options;
    if (this.#stopping) {
      // Another worker takes it (or this one, started again).
      await this.#db(() => addDeliveryJob(db, messageId, 0));
      return 'deferred';
    }
    const encryptionKeys = config.secretEncryptionKeys;
    if (encryptionKeys.length === 0) {
      if (!this.#toldNoKey) {
        this.#toldNoKey = true;
        this.#log.error('SECRET_ENCRYPTION_KEY is not set in this worker: webhooks cannot be signed; their messages wait until it is');
      }
      await this.#db(() => addDeliveryJob(db, messageId, NO_KEY_RETRY_MS));
      return 'deferred';
    }
    if (this.#tries.size + this.#claims.size >= config.webhooks.maxInFlight) {
      await this.#db(() => addDeliveryJob(db, messageId, BUSY_RETRY_MS));
      return 'deferred';
    }
    const claiming = this.#db(() => claimMessage(db, messageId, this.workerId));
    this.#claims.add(claiming);
    let claim: Awaited<typeof claiming>;
    try {
      claim = await claiming;
    } finally {
      this.#claims.delete(claiming);
    }
    if (claim.kind === 'abandoned') {
      this.#log.info({ messageId }, 'webhook message abandoned: its endpoint is disabled');
      return 'abandoned';
    }
    if (claim.kind === 'nothing') return 'nothing';
    this.#fly(claim.message, encryptionKeys);
    return 'started';
  }

  /**
   * Hands back the tries of dead workers (the supervisor's sweep; never those of `live`): each is
   * recorded as failed and its message retried at once. Returns how many.
   */
  async recoverLost(deadAfterMs: number, live: readonly string[], limit = 1_000): Promise<number> {
    const recovered = await recoverLostDeliveries(this.#options.db, deadAfterMs, live, limit);
    if (recovered > 0) {
      this.#options.metrics.webhookDeliveries.inc({ outcome: 'failed' }, recovered);
      this.#log.warn({ messages: recovered }, 'webhook tries lost with their worker; retrying them');
    }
    return recovered;
  }

  /** Takes no more; lets tries in flight finish for SHUTDOWN_GRACE_MS, then aborts the rest (retried at once). */
  stop(): Promise<void> {
    this.#stopped ??= this.#stop();
    return this.#stopped;
  }

  async #stop(): Promise<void> {
    this.#stopping = true;
    await Promise.allSettled([...this.#claims]);
    await landWithin(this.#options.config.shutdownGraceMs, () => this.#tries.values(), ABORTED_BY_SHUTDOWN, () =>
      this.#abandoning.abort(),
    );
    await this.#agent.destroy();
  }

  #fly(message: ClaimedMessage, encryptionKeys: readonly Buffer[]): void {
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(ABORTED_BY_TIMEOUT), this.#options.config.webhooks.timeoutMs);
    const done = this.#try(message, encryptionKeys, controller.signal).finally(() => {
      clearTimeout(timer);
      this.#tries.delete(controller);
    });
    this.#tries.set(controller, { controller, done });
  }

  /** One try: send, then record how it went. Never rejects. */
  async #try(message: ClaimedMessage, encryptionKeys: readonly Buffer[], signal: AbortSignal): Promise<void> {
    const begun = performance.now();
    let answer: Answer;
    try {
      answer = await this.#send(message, encryptionKeys, signal);
    } catch (error) {
      // A bug on our side (#send classifies every failure it knows): the try still ends, and the
      // message is retried on the schedule.
      this.#log.error({ messageId: message.id, err: errorSummary(error) }, 'webhook try failed unexpectedly');
      answer = { kind: 'failed', httpStatus: null, error: 'the delivery could not be prepared' };
    }
    const durationMs = Math.round(performance.now() - begun);
    if (answer.kind === 'failed' && signal.reason === ABORTED_BY_SHUTDOWN) {
      answer = { kind: 'failed', httpStatus: null, error: 'the worker shut down during the try', retryAtOnce: true };
    }
    const outcome = answer.kind === 'delivered' ? 'succeeded' : answer.kind === 'gone' ? 'disabled' : 'failed';
    this.#options.metrics.webhookDeliveries.inc({ outcome });
    const end: TryEnd = {
      messageId: message.id,
      endpointId: message.endpoint_id,
      tryNumber: message.tries,
      kind: answer.kind,
      httpStatus: answer.httpStatus,
      error: answer.kind === 'delivered' ? null : answer.kind === 'gone' ? 'HTTP 410 Gone: the endpoint is disabled' : answer.error,
      durationMs,
    };
    if (answer.kind === 'failed') {
      // A try cut short by our own shutdown is not the endpoint's failure: it is made again at once.
      end.retryInMs = answer.retryAtOnce
        ? 0
        : nextTryDelay(this.#options.config.webhooks.retryScheduleMs, message.tries, answer.retryAfterMs);
    }
    const context = { messageId: message.id, endpointId: message.endpoint_id, try: message.tries, httpStatus: answer.httpStatus, durationMs };
    try {
      const status = await this.#db(() => finishTry(this.#options.db, end), { untilAbandoned: true });
      if (answer.kind === 'delivered') this.#log.debug({ ...context, stale: !status }, 'webhook delivered');
      else if (answer.kind === 'gone') this.#log.warn({ ...context, stale: !status }, 'webhook endpoint answered 410 Gone: disabled');
      else this.#log.info({ ...context, error: end.error, retryInMs: end.retryInMs, status: status ?? 'stale' }, 'webhook try failed');
    } catch (error) {
      // Given up at shutdown, or a failure no retry mends: the message stays delivering under
      // this worker's id, and is handed back by a sweep once this worker is gone (as when the
      // process is killed while retrying).
      this.#log.error({ ...context, err: errorSummary(error) }, 'could not record a webhook try');
    }
  }

  async #send(message: ClaimedMessage, encryptionKeys: readonly Buffer[], signal: AbortSignal): Promise<Answer> {
    let secrets: string[];
    try {
      secrets = [message.secret_ciphertext, message.previous_secret_ciphertext]
        .filter((sealed): sealed is Buffer => sealed !== null)
        .map((sealed) => decryptSecret(sealed, message.endpoint_id, encryptionKeys));
    } catch {
      return {
        kind: 'failed',
        httpStatus: null,
        error: "the endpoint's secret could not be decrypted: no key of SECRET_ENCRYPTION_KEY(S) is the one it was stored with",
      };
    }
    const body = eventBody(message);
    const timestamp = Math.floor(Date.now() / 1000);
    const signatures = await Promise.all(secrets.map((secret) => signWebhook(secret, message.id, timestamp, body)));
    let response: Awaited<ReturnType<typeof request>>;
    try {
      response = await request(message.url, {
        method: 'POST',
        headers: {
          'content-type': 'application/json',
          'user-agent': 'chat-gateway-webhooks',
          'webhook-id': message.id,
          'webhook-timestamp': String(timestamp),
          'webhook-signature': signatures.join(' '),
        },
        body,
        signal,
        dispatcher: this.#agent,
      });
    } catch (error) {
      return { kind: 'failed', httpStatus: null, error: this.#failureOf(error, signal) };
    }
    const status = response.statusCode;
    // Read and dropped, so that the connection can carry the next try.
    await response.body.dump({ limit: MAX_ANSWER_BYTES }).catch(() => {});
    if (status >= 200 && status < 300) return { kind: 'delivered', httpStatus: status };
    if (status === 410) return { kind: 'gone', httpStatus: status };
    const retryAfter = response.headers['retry-after'];
    return {
      kind: 'failed',
      httpStatus: status,
      error: `HTTP ${status}`,
      retryAfterMs: parseRetryAfter((Array.isArray(retryAfter) ? retryAfter[0] : retryAfter) ?? null),
    };
  }

  /** Why a try got no answer, in our words. */
  #failureOf(error: unknown, signal: AbortSignal): string {
    if (signal.aborted) {
      return signal.reason === ABORTED_BY_TIMEOUT
        ? `no answer within ${this.#options.config.webhooks.timeoutMs / 1000} s`
        : 'the try was aborted';
    }
    const forbidden = findCause(error, (cause) => cause instanceof ForbiddenAddressError);
    if (forbidden) return (forbidden as ForbiddenAddressError).message;
    const code = codeOf(error);
    switch (code) {
      case 'ECONNREFUSED':
        return 'connection refused';
      case 'ECONNRESET':
      case 'UND_ERR_SOCKET':
        return 'the connection was closed before an answer';
      case 'ENOTFOUND':
        return 'the host name does not resolve';
      case 'EAI_AGAIN':
        return 'the host name could not be resolved (DNS lookup failed)';
      case 'UND_ERR_CONNECT_TIMEOUT':
      case 'ETIMEDOUT':
        return 'no connection within the timeout';
      case 'EHOSTUNREACH':
      case 'ENETUNREACH':
        return 'the host is unreachable';
    }
    if (code && /^(ERR_TLS_|ERR_SSL_|CERT_|UNABLE_TO_|DEPTH_ZERO_|SELF_SIGNED_)/.test(code)) return `TLS failed: ${code}`;
    this.#log.warn({ err: errorSummary(error) }, 'webhook try failed unexpectedly');
    return `connection failed: ${code ?? 'unknown error'}`;
  }

  /** Runs a statement, retrying while the database is unavailable: for OUTAGE_PATIENCE_MS, or `untilAbandoned`. */
  #db<T>(statement: () => Promise<T>, options: { untilAbandoned?: boolean } = {}): Promise<T> {
    return whileUnavailable(statement, {
      ...(options.untilAbandoned ? { signal: this.#abandoning.signal } : { maxWaitMs: OUTAGE_PATIENCE_MS }),
      log: { logger: this.#log, message: 'database unavailable; retrying' },
    });
  }
}

/** The error, or one of its causes (or of an AggregateError's errors), that satisfies `test`. */
function findCause(error: unknown, test: (cause: unknown) => boolean, depth = 0): unknown {
  if (error === undefined || error === null || depth > 5) return undefined;
  if (test(error)) return error;
  if (error instanceof AggregateError) {
    for (const inner of error.errors) {
      const found = findCause(inner, test, depth + 1);
      if (found) return found;
    }
  }
  return error instanceof Error ? findCause(error.cause, test, depth + 1) : undefined;
}

/** The first string `code` of the error or its causes. */
function codeOf(error: unknown): string | undefined {
  const found = findCause(error, (cause) => typeof (cause as { code?: unknown })?.code === 'string');
  return found ? (found as { code: string }).code : undefined;
}
