// Which lane an accepted request waits in (CONTRACT.md section 9): a live request goes to the
// first upstream whose models match its model, a test request to the simulator. A live model no
// upstream serves, and a test-delay beyond the ceiling, are refused before anything is stored.
import type { Config } from '../config.ts';
import type { Db } from '../db/pool.ts';
import { invalidRequest } from '../errors.ts';
import type { KeyMode } from '../ids.ts';
import { ensureLane, type LaneKey } from './repository.ts';
import { estimatePromptTokens, loadTokenizer } from './tokens.ts';
import { testBehaviour } from '../upstream/simulator.ts';
import { routeModel, SIMULATOR } from '../upstream/upstreams.ts';

/** The simulator's one lane takes every test-mode model. */
const ANY_MODEL = '*';
// Lane ids remembered; past this many (models are the clients' to choose), the memory starts over.
const MAX_REMEMBERED = 10_000;

export interface Routed {
  laneId: string;
  /** Prompt tokens estimated from the body, for a lane with tokens_per_minute; null otherwise. */
  promptTokensEstimate: number | null;
}

export interface RoutedBody {
  model: string;
  messages: readonly { role: string; content: string }[];
}

export class LaneRouter {
  readonly #db: Db;
  readonly #config: Pick<Config, 'upstreams' | 'testDelayMaxMs'>;
  /** Lane ids by mode, upstream and model; concurrent first uses share one read. */
  readonly #ids = new Map<string, Promise<string>>();

  constructor(db: Db, config: Pick<Config, 'upstreams' | 'testDelayMaxMs'>) {
    this.#db = db;
    this.#config = config;
    // Loading the tokenizer holds the event loop noticeably: at start-up, not on a request.
    if (config.upstreams.some((upstream) => upstream.limits.tokensPerMinute !== undefined)) loadTokenizer();
  }

  /** The lane of a request of this mode and body; a 400 naming `model` when there is none. */
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
      return { laneId: await this.#laneId({ mode, upstream: SIMULATOR, model: ANY_MODEL }), promptTokensEstimate: null };
    }
    const upstream = routeModel(this.#config.upstreams, body.model);
    if (!upstream) {
      throw invalidRequest('invalid_parameter', `Invalid 'model': no upstream serves the model '${body.model}'.`, 'model');
    }
    const estimate = upstream.limits.tokensPerMinute === undefined ? null : estimatePromptTokens(body);
    return { laneId: await this.#laneId({ mode, upstream: upstream.name, model: body.model }), promptTokensEstimate: estimate };
  }

  #laneId(key: LaneKey): Promise<string> {
    const name = `${key.mode}\n${key.upstream}\n${key.model}`;
    let id = this.#ids.get(name);
    if (id === undefined) {
      if (this.#ids.size >= MAX_REMEMBERED) this.#ids.clear();
      id = ensureLane(this.#db, key);
      this.#ids.set(name, id);
      // A failed read is not remembered: the next request tries again.
      id.catch(() => this.#ids.delete(name));
    }
    return id;
  }
}
