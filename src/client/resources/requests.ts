// client.requests: GET /v1/requests/{id} (docs/api.md, "Looking up a request"), polling it to
// the end, and POST /v1/requests/{id}/cancel ("Cancelling a request").
import { Backoff, jitter } from '../backoff.ts';
import { GatewayError } from '../errors.ts';
import { checkMilliseconds, type RequestFunction, type RequestOptions } from '../request.ts';
import { sleep } from '../retry.ts';
import type { CancelledRequestRecord, RequestRecord, TerminalRequestRecord } from '../types.ts';

export interface PollOptions extends RequestOptions {
  /** The first pause between lookups, in milliseconds; it doubles after each one. Default 250, at most 2^31 - 1. */
  pollIntervalMs?: number | undefined;
  /** The longest pause between lookups. Default 5000, at most 2^31 - 1. */
  maxPollIntervalMs?: number | undefined;
}

export class Requests {
  readonly #request: RequestFunction;

  constructor(request: RequestFunction) {
    this.#request = request;
  }

  /** The request record; a NotFoundError for an unknown id or one of another project or mode. */
  async get(id: string, options?: RequestOptions): Promise<RequestRecord> {
    return this.#request({ method: 'GET', path: `/v1/requests/${idSegment(id)}` }, options);
  }

  /**
   * Cancels the request: one that is queued or retrying is never attempted, a running attempt is
   * aborted. Resolves to its record, now `cancelled`; cancelling a cancelled request answers its
   * record again, so the call is retried like a lookup. A ConflictError (code
   * `request_already_finished`) when it is completed or failed already, and a NotFoundError
   * for an unknown id or one of another project or mode.
   */
  async cancel(id: string, options?: RequestOptions): Promise<CancelledRequestRecord> {
    return this.#request({ method: 'POST', path: `/v1/requests/${idSegment(id)}/cancel` }, options);
  }

  /**
   * Looks the request up until it is completed, failed or cancelled, pausing longer each time,
   * and returns that final record. Give `signal` to stop waiting; `timeout` applies to each lookup.
   */
  async poll(id: string, options: PollOptions = {}): Promise<TerminalRequestRecord> {
    const { pollIntervalMs = 250, maxPollIntervalMs = 5_000, ...requestOptions } = options;
    const longest = checkMilliseconds('maxPollIntervalMs', maxPollIntervalMs);
    // A Backoff whose ceiling is below its first wait keeps that first wait: the longest pause
    // asked for bounds the first one too.
    const pauses = new Backoff(Math.min(checkMilliseconds('pollIntervalMs', pollIntervalMs), longest), longest);
    for (;;) {
      const record = await this.get(id, requestOptions);
      if (record.status === 'completed' || record.status === 'failed' || record.status === 'cancelled') return record;
      // Up to a fifth less at random, so pollers started together spread out.
      await sleep(jitter(pauses.next(), 0.2), options.signal);
    }
  }
}

/**
 * The id as a path segment, percent-encoded. `.` and `..` are refused with a GatewayError: a URL
 * resolves such a segment away, encoded or not (GET /v1/requests/.. is GET /v1/, and a cancel of
 * `.` is POST /v1/requests/cancel), so the call would go to another route.
 */
function idSegment(id: string): string {
  if (id === '.' || id === '..') {
    throw new GatewayError(`'${id}' is not a request id, and cannot be sent as one: a URL resolves it away.`);
  }
  return encodeURIComponent(id);
}
