// client.requests: GET /v1/requests/{id} (CONTRACT.md section 3), and polling it to the end.
import type { RequestFunction, RequestOptions } from '../client.ts';
import { sleep } from '../retry.ts';
import type { RequestRecord, TerminalRequestRecord } from '../types.ts';

export interface PollOptions extends RequestOptions {
  /** The first pause between lookups, in milliseconds; it doubles after each one. Default 250. */
  pollIntervalMs?: number | undefined;
  /** The longest pause between lookups. Default 5000. */
  maxPollIntervalMs?: number | undefined;
}

export class Requests {
  readonly #request: RequestFunction;

  constructor(request: RequestFunction) {
    this.#request = request;
  }

  /** The request record; a NotFoundError for an unknown id or one of another project or mode. */
  get(id: string, options?: RequestOptions): Promise<RequestRecord> {
    return this.#request({ method: 'GET', path: `/v1/requests/${encodeURIComponent(id)}` }, options);
  }

  /**
   * Looks the request up until it is completed or failed, pausing longer each time, and
   * returns that final record. Give `signal` to stop waiting; `timeout` applies to each lookup.
   */
  async poll(id: string, options: PollOptions = {}): Promise<TerminalRequestRecord> {
    const { pollIntervalMs = 250, maxPollIntervalMs = 5_000, ...requestOptions } = options;
    for (let pause = pollIntervalMs; ; pause = Math.min(pause * 2, maxPollIntervalMs)) {
      const record = await this.get(id, requestOptions);
      if (record.status === 'completed' || record.status === 'failed') return record;
      // Up to a fifth less at random, so pollers started together spread out.
      await sleep(pause * (1 - Math.random() * 0.2), options.signal);
    }
  }
}
