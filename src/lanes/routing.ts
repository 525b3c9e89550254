// Which queue an accepted request waits in: a live request, its model's, served by every upstream
// whose models match it (its deployments); a test request, the simulator's one queue. A live
// model no upstream serves, a new model beyond MAX_PATTERN_MODELS that only a pattern serves, a
// prompt larger than a minute of its deployments' tokens, and a test-delay beyond the ceiling,
// are refused before anything is stored.
//
// Queues are remembered, so that a request for a known model costs no statement here; but for a
// sixth of PRUNE_IDLE_QUEUES_AFTER at most: looking a queue up again marks it used, so a queue
// this process routes to is never idle long enough to be pruned (worker/prune.ts). Should one be
// pruned all the same, the insert finds it gone and the request is routed again (requests/service.ts).
//
// A model without a queue gets it from its request: route() answers a QueueCreation, which
// creates the queue in the transaction that stores the request, so that a request refused there
// (a nonce replayed, an idempotency key reused) leaves no queue behind, nor a place under
// MAX_PATTERN_MODELS taken. The first uses of a model in a process wait for the one creating its
// queue, and then find it.
//
// A new model that only a pattern serves costs more: its queue is created under a lock that all
// processes take in turn, to hold MAX_PATTERN_MODELS, and hold until their transaction ends. A
// flood of invented names must not take the pool's connections with it: each process creates
// one such queue at a time, with a short line behind it (beyond it, a 503 busy), and once the
// bound is found reached, new names are refused for a second without taking the lock (a queue
// that exists is still found).
import { LRUCache } from 'lru-cache';
import type { Config } from '../config.ts';
import type { Db } from '../db/pool.ts';
import { invalidRequest, serviceUnavailable } from '../errors.ts';
import type { KeyMode } from '../ids.ts';
import { Line } from '../line.ts';
import { createPatternQueue, ensureQueue, useQueue, type QueueKey } from './repository.ts';
import { estimatePromptTokens, loadTokenizer } from './tokens.ts';
import { testBehaviour } from '../upstream/simulator.ts';
import { deploymentsOf } from '../upstream/upstreams.ts';

/** The simulator's one queue takes every test-mode model. */
export const ANY_MODEL = '*';
/** Queue ids remembered at most (the least recently used are forgotten first). */
export const QUEUES_REMEMBERED = 10_000;
/** How long a process refuses new pattern-served models without a look, once it found the bound reached. */
const BOUND_REACHED_MS = 1_000;
/** Creations of pattern-served queues waiting for their turn in a process (one is under way). */
const CREATIONS_WAITING = 64;

type RouterConfig = Pick<Config, 'upstreams' | 'testDelayMaxMs' | 'maxPatternModels' | 'pruneIdleQueuesAfterMs'>;

export interface Routed {
  /** The queue; undefined when the model has none yet, and `creation` creates it with the request. */
  queueId: string | undefined;
  /** Prompt tokens estimated from the body, when a deployment has tokens_per_minute; null otherwise. */
  promptTokensEstimate: number | null;
  creation?: QueueCreation | undefined;
}

/**
 * The creation of a queue with the first request stored in it. The other first uses of its model
 * in this process wait until it is run and has ended, or released: one or the other must follow.
 */
export interface QueueCreation {
  /**
   * In one transaction, creates the queue (a 400 when MAX_PATTERN_MODELS refuses it) and runs
   * `store` with its id; commits when `keep` says so of what `store` resolved to, and else rolls
   * back, queue and all. Resolves to what `store` did; the queue is remembered once committed.
   */
  run<T>(store: (tx: Db, queueId: string) => Promise<T>, keep: (stored: T) => boolean): Promise<T>;
  /** Lets the model's other first uses go on without it (run releases it too). */
  release(): void;
}

export interface RoutedBody {
  model: string;
  messages: readonly { role: string; content: string }[];
}

export class QueueRouter {
  readonly #db: Db;
  readonly #config: RouterConfig;
  /** The models the upstreams list by name: MAX_PATTERN_MODELS does not count theirs. */
  readonly #named: readonly string[];
  /** Queue ids by mode and model (undefined: none found); concurrent first uses share one read. */
  readonly #ids: LRUCache<string, Promise<string | undefined>>;
  /** The creations handed out, by mode and model: each settles when it has ended. */
  readonly #creating = new Map<string, Promise<void>>();
  /** Creations of queues for models only a pattern serves: one at a time. */
  readonly #creations = new Line({
    inFlight: 1,
    waiting: CREATIONS_WAITING,
    refusal: () => serviceUnavailable(1, 'The gateway is busy; try again in a moment.'),
  });
  /** Until when (performance.now()) new pattern-served models are refused without a look. */
  #boundReachedUntil = 0;

  constructor(db: Db, config: RouterConfig, options: { remembered?: number } = {}) {
    this.#db = db;
    this.#config = config;
    this.#named = [...new Set(config.upstreams.flatMap((upstream) => upstream.models.filter((model) => !model.endsWith('*'))))];
    this.#ids = new LRUCache({
      max: options.remembered ?? QUEUES_REMEMBERED,
      ttl: Math.max(1, Math.floor(config.pruneIdleQueuesAfterMs / 6)),
    });
    // Loading the tokenizer holds the event loop noticeably: at start-up, not on a request.
    if (config.upstreams.some((upstream) => upstream.limits.tokensPerMinute !== undefined)) loadTokenizer();
  }

  /**
   * The queue of a request of this mode and body, or its creation when it has none yet (to be run
   * or released); a 400 naming `model` when no upstream serves it.
   */
  async route(mode: KeyMode, body: RoutedBody): Promise<Routed> {
    if (mode === 'test') {
      const behaviour = testBehaviour(body.model);
      if (behaviour?.kind === 'delay' && behaviour.value > this.#config.testDelayMaxMs) {
        throw invalidRequest(
          'invalid_parameter',
          `Invalid 'model': test-delay-<ms> takes at most ${this.#config.testDelayMaxMs} ms.`,
          'model',
        );
      }
      return { ...(await this.#queue({ mode, model: ANY_MODEL })), promptTokensEstimate: null };
    }
    const deployments = deploymentsOf(this.#config.upstreams, body.model);
    if (deployments.length === 0) {
      throw invalidRequest('invalid_parameter', `Invalid 'model': no upstream serves the model '${body.model}'.`, 'model');
    }
    const counted = deployments.some((upstream) => upstream.limits.tokensPerMinute !== undefined);
    const estimate = counted ? estimatePromptTokens(body) : null;
    // A prompt larger than a minute of every deployment's tokens would never fit: refused, rather
    // than shutting a lane for minutes by overdrawing it (a lane without the limit takes any).
    if (estimate !== null && deployments.every((upstream) => estimate > (upstream.limits.tokensPerMinute ?? Infinity))) {
      const most = Math.max(...deployments.map((upstream) => upstream.limits.tokensPerMinute!));
      throw invalidRequest(
        'invalid_parameter',
        `Invalid 'messages': the prompt is estimated at ${estimate} tokens, more than the ${most} tokens per minute that the upstreams serving '${body.model}' allow.`,
        'messages',
      );
    }
    const named = deployments.some((upstream) => upstream.models.includes(body.model));
    return { ...(await this.#queue({ mode, model: body.model }, named)), promptTokensEstimate: estimate };
  }

  /** Forgets the queue of this mode and model (it was found pruned): the next route looks it up. */
  forget(mode: KeyMode, model: string): void {
    this.#ids.delete(keyOf({ mode, model: mode === 'test' ? ANY_MODEL : model }));
  }

  /** Queue ids remembered now. */
  get remembered(): number {
    return this.#ids.size;
  }

  /** The queue, or its creation; `named`: an upstream lists the model by name (never refused). */
  async #queue(key: QueueKey, named = true): Promise<Pick<Routed, 'queueId' | 'creation'>> {
    const name = keyOf(key);
    for (;;) {
      const creating = this.#creating.get(name);
      if (creating !== undefined) {
        await creating;
        continue;
      }
      const queueId = await this.#lookUp(name, key);
      if (queueId !== undefined) return { queueId };
      // Another first use may have been handed the creation while this one looked.
      if (this.#creating.has(name)) continue;
      if (!named && performance.now() < this.#boundReachedUntil) throw this.#boundReached(key);
      return { queueId: undefined, creation: this.#creation(name, key, named) };
    }
  }

  /** The queue's id, its use recorded; undefined when it has no row. */
  #lookUp(name: string, key: QueueKey): Promise<string | undefined> {
    let id = this.#ids.get(name);
    if (id === undefined) {
      id = useQueue(this.#db, key);
      this.#ids.set(name, id);
      // Neither a failed read nor a queue not found is remembered: the next request asks again.
      const remembered = id;
      const forget = () => {
        if (this.#ids.peek(name) === remembered) this.#ids.delete(name);
      };
      id.then((found) => found === undefined && forget(), forget);
    }
    return id;
  }

  #creation(name: string, key: QueueKey, named: boolean): QueueCreation {
    let end!: () => void;
    const ended = new Promise<void>((resolve) => (end = resolve));
    this.#creating.set(name, ended);
    const release = () => {
      if (this.#creating.get(name) === ended) this.#creating.delete(name);
      end();
    };
    const run = async <T>(store: (tx: Db, queueId: string) => Promise<T>, keep: (stored: T) => boolean): Promise<T> => {
      try {
        const created = named
          ? await this.#createIn(store, keep, (tx) => ensureQueue(tx, key))
          : await this.#creations.run(() => this.#createIn(store, keep, (tx) => this.#createPatternQueue(tx, key)));
        if (created.committed) this.#ids.set(name, Promise.resolve(created.queueId));
        return created.stored;
      } finally {
        release();
      }
    };
    return { run, release };
  }

  async #createIn<T>(
    store: (tx: Db, queueId: string) => Promise<T>,
    keep: (stored: T) => boolean,
    create: (tx: Db) => Promise<string>,
  ): Promise<{ stored: T; queueId: string; committed: boolean }> {
    try {
      return await this.#db.transaction().execute(async (tx) => {
        const queueId = await create(tx);
        const stored = await store(tx, queueId);
        if (!keep(stored)) throw new RolledBack({ stored, queueId, committed: false });
        return { stored, queueId, committed: true };
      });
    } catch (error) {
      if (error instanceof RolledBack) return error.outcome as { stored: T; queueId: string; committed: boolean };
      throw error;
    }
  }

  /**
   * Creates the queue of a model only a pattern serves in `tx`; a 400 when it would be one too
   * many. The lock that creations take in turn is held until `tx` ends: another process counts
   * the queue only once it is committed.
   */
  async #createPatternQueue(tx: Db, key: QueueKey): Promise<string> {
    const id = await createPatternQueue(tx, key, { max: this.#config.maxPatternModels, named: this.#named });
    if (id !== undefined) return id;
    this.#boundReachedUntil = performance.now() + BOUND_REACHED_MS;
    throw this.#boundReached(key);
  }

  #boundReached(key: QueueKey) {
    return invalidRequest(
      'invalid_parameter',
      `Invalid 'model': the gateway already serves ${this.#config.maxPatternModels} models that no upstream lists by name, as many as it may; '${key.model}' would be one more.`,
      'model',
    );
  }
}

/** Thrown to roll a creation's transaction back, with what it stored (nothing, once rolled back). */
class RolledBack {
  readonly outcome: unknown;
  constructor(outcome: unknown) {
    this.outcome = outcome;
  }
}

const keyOf = (key: QueueKey) => `${key.mode}\n${key.model}`;
