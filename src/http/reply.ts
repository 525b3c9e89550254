// A Reply (context.ts) put on the wire: through Koa, or, for an answer sent after Koa let go
// of the request (a wait=true request that waited), straight onto the response.
import type { ServerResponse } from 'node:http';
import type { ParameterizedContext } from 'koa';
import type { Reply } from './context.ts';

/** The media type of every answer's JSON body. */
const JSON_TYPE = 'application/json; charset=utf-8';

/** A JSON body's text: a string as it is, any other value serialized. */
const jsonText = (body: string | object): string => (typeof body === 'string' ? body : JSON.stringify(body));

/**
 * Sets a JSON body on Koa's context, for Koa to send: its text (or bytes) as it is, or a value
 * serialized here. Its type is set as it is sent: Koa would look a short name up, twice.
 */
export function setJsonBody(ctx: ParameterizedContext, body: string | Buffer | object): void {
  ctx.set('Content-Type', JSON_TYPE);
  ctx.body = Buffer.isBuffer(body) ? body : jsonText(body);
}

/** Sets the reply on Koa's context, for Koa to send. */
export function setReply(ctx: ParameterizedContext, reply: Reply): void {
  ctx.status = reply.status;
  setJsonBody(ctx, reply.body);
  if (reply.replayed) ctx.set('Idempotent-Replayed', 'true');
  if (reply.headers) ctx.set(reply.headers);
}

/** What Koa's respond() does for a JSON body, on a response Koa has left to us. */
export function send(res: ServerResponse, reply: Reply): void {
  // As Koa's ctx.writable: a client that hung up gets nothing.
  if (res.destroyed || res.writableEnded || (res.socket && !res.socket.writable)) {
    res.end();
    return;
  }
  const body = jsonText(reply.body);
  res.statusCode = reply.status;
  res.setHeader('Content-Type', JSON_TYPE);
  if (reply.replayed) res.setHeader('Idempotent-Replayed', 'true');
  for (const [name, value] of Object.entries(reply.headers ?? {})) res.setHeader(name, value);
  res.setHeader('Content-Length', Buffer.byteLength(body));
  res.end(body);
}
