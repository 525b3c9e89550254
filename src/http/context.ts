// What the middleware chain leaves on ctx.state for the handlers.
import type { ParameterizedContext } from 'koa';
import type { Auth } from '../keys/auth.ts';
import type { VerifiedSignature } from '../keys/signatures.ts';

export interface GatewayState {
  /** Set by authenticate(): the key's project and mode. */
  auth: Auth;
  /** Set by readBody() on routes with a body: its exact bytes. */
  body?: Buffer;
  /** Set by verifyRequestSignature() when the request was signed. */
  signature?: VerifiedSignature;
  /**
   * Set by a handler whose answer comes later (a wait=true request still waiting). The
   * middleware chain then ends at once and the answer is sent when this settles (app.ts), so
   * that a request held open keeps none of the chain's frames, nor this context.
   */
  later?: Promise<Reply>;
}

/** An answer sent outside Koa: a JSON body (text as it is, or a value to serialize). */
export interface Reply {
  status: number;
  body: string | object;
  /** Sets Idempotent-Replayed: true. */
  replayed?: boolean;
  headers?: Record<string, string>;
}

export type GatewayContext = ParameterizedContext<GatewayState>;

/**
 * What a route does before its handler (authenticate, read the body, verify the signature).
 * Steps finish before the handler starts: a request held open keeps none of their frames.
 */
export type Step = (ctx: GatewayContext) => Promise<void> | void;
