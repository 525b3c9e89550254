// client.chat.completions: POST /v1/chat/completions (docs/api.md, "Submitting a request").
import type { RequestFunction, RequestOptions } from '../request.ts';
import type { ChatCompletionCreateParams, ChatCompletionCreateResult } from '../types.ts';

export class Chat {
  readonly completions: Completions;

  constructor(request: RequestFunction) {
    this.completions = new Completions(request);
  }
}

export class Completions {
  readonly #request: RequestFunction;

  constructor(request: RequestFunction) {
    this.#request = request;
  }

  /**
   * Submits a chat completion request. Resolves to the completion (`object: 'chat.completion'`)
   * when it finished within the server's wait (`wait: true`), otherwise to the acknowledgement
   * (`object: 'chat.completion.async'`) whose id `client.requests.get` / `poll` look up.
   */
  create(params: ChatCompletionCreateParams, options?: RequestOptions): Promise<ChatCompletionCreateResult> {
    // Generated once per call, before the first attempt: every retry of this call then names
    // the same request, and the server answers it instead of creating a second one.
    const body = { ...params, idempotency_key: params.idempotency_key ?? `auto-${crypto.randomUUID()}` };
    return this.#request({ method: 'POST', path: '/v1/chat/completions', body }, options);
  }
}
