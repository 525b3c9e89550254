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
// A new model that only a pattern serves costs more: its queue is created under a lock that all
// processes take in turn, to hold MAX_PATTERN_MODELS. A flood of invented names must not take
// the pool's connections with it: each process creates one such queue at a time, with a short
// line behind it (beyond it, a 503 busy), and once the bound is found reached, new names are
// refused for a second without taking the lock (a queue that exists is still found).
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
  queueId: string;
  /** Prompt tokens estimated from the body, when a deployment has tokens_per_minute; null otherwise. */
  promptTokensEstimate: number | null;
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
  /** Queue ids by mode and model; concurrent first uses share one read. */
  readonly #ids: LRUCache<string, Promise<string>>;
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

  /** The queue of a request of this mode and body; a 400 naming `model` when no upstream serves it. */
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
      return { queueId: await this.#queueId({ mode, model: ANY_MODEL }), promptTokensEstimate: null };
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
    const queueId = await this.#queueId({ mode, model: body.model }, named);
    return { queueId, promptTokensEstimate: estimate };
  }

  /** Forgets the queue of this mode and model (it was found pruned): the next route looks it up. */
  forget(mode: KeyMode, model: string): void {
    this.#ids.delete(keyOf({ mode, model: mode === 'test' ? ANY_MODEL : model }));
  }

  /** Queue ids remembered now. */
  get remembered(): number {
    return this.#ids.size;
  }

  /** The queue's id; `named`: an upstream lists the model by name (never refused). */
  #queueId(key: QueueKey, named = true): Promise<string> {
    const name = keyOf(key);
    let id = this.#ids.get(name);
    if (id === undefined) {
      id = named ? ensureQueue(this.#db, key) : this.#patternQueue(key);
      this.#ids.set(name, id);
      // A failed read or a refusal is not remembered: the next request asks again.
      const remembered = id;
      id.catch(() => {
        if (this.#ids.peek(name) === remembered) this.#ids.delete(name);
      });
    }
    return id;
  }

  async #patternQueue(key: QueueKey): Promise<string> {
    const found = await useQueue(this.#db, key);
    if (found !== undefined) return found;
    const max = this.#config.maxPatternModels;
    if (performance.now() >= this.#boundReachedUntil) {
      const id = await this.#creations.run(() => createPatternQueue(this.#db, key, { max, named: this.#named }));
      if (id !== undefined) return id;
      this.#boundReachedUntil = performance.now() + BOUND_REACHED_MS;
    }
    throw invalidRequest(
      'invalid_parameter',
      `Invalid 'model': the gateway already serves ${max} models that no upstream lists by name, as many as it may; '${key.model}' would be one more.`,
      'model',
    );
  }
}

const keyOf = (key: QueueKey) => `${key.mode}\n${key.model}`;
