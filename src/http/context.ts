// What the middleware chain leaves on ctx.state for the handlers.
import type { ParameterizedContext } from 'koa';
import type { Auth } from '../keys/service.ts';

export interface GatewayState {
  /** Set by authenticate(): the key's project and mode. */
  auth: Auth;
  /** Set by readBody(): the exact bytes of the request body (empty for GET). */
  body: Buffer;
}

export type GatewayContext = ParameterizedContext<GatewayState>;
