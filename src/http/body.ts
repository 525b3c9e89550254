// Reads the raw body of a JSON request (kept as bytes: the signature covers them exactly),
// enforcing MAX_BODY_BYTES and the media type, then parses it.
import getRawBody from 'raw-body';
import { invalidRequest, requestTooLarge, unsupportedMediaType } from '../errors.ts';
import type { GatewayContext, Step } from './context.ts';

export function readBody(maxBodyBytes: number): Step {
  return async (ctx) => {
    // Media types are case-insensitive, and Koa gives the header's own text before any `;`.
    if (ctx.request.type.trim().toLowerCase() !== 'application/json') throw unsupportedMediaType();
    const charset = ctx.request.charset;
    if (charset && charset.toLowerCase() !== 'utf-8' && charset.toLowerCase() !== 'utf8') throw unsupportedMediaType();
    const encoding = ctx.get('content-encoding');
    if (encoding && encoding.toLowerCase() !== 'identity') throw unsupportedMediaType();
    continueIfExpected(ctx);
    try {
      ctx.state.body = await getRawBody(ctx.req, {
        limit: maxBodyBytes,
        length: ctx.get('content-length') || null,
      });
    } catch (error) {
      const type = (error as { type?: unknown }).type;
      if (type === 'entity.too.large') throw requestTooLarge(maxBodyBytes);
      throw invalidRequest('invalid_body', 'The body could not be read completely.');
    }
  };
}

/** For a route that takes no body (a cancel): one sent anyway is refused, as the signature covers none. */
export function noBody(): Step {
  return async (ctx) => {
    let body: Buffer;
    continueIfExpected(ctx);
    try {
      body = await getRawBody(ctx.req, { limit: 1024, length: ctx.get('content-length') || null });
    } catch {
      throw invalidRequest('invalid_body', 'This request takes no body.');
    }
    if (body.length > 0) throw invalidRequest('invalid_body', 'This request takes no body.');
  };
}

/**
 * A client that sent `Expect: 100-continue` sends its body once told to continue, which the
 * server leaves to this moment: a request refused before its body is read is spared sending it.
 */
function continueIfExpected(ctx: GatewayContext): void {
  if (ctx.get('expect').toLowerCase() === '100-continue' && !ctx.res.headersSent) ctx.res.writeContinue();
}

const utf8 = new TextDecoder('utf-8', { fatal: true });

export function parseJson(body: Buffer): unknown {
  try {
    return JSON.parse(utf8.decode(body));
  } catch {
    throw invalidRequest('invalid_json', 'The body is not valid JSON (UTF-8).');
  }
}
