// gateway request <METHOD> <path> [body]: one signed call to a running gateway, for people
// debugging without the client library. Reads GATEWAY_API_KEY, GATEWAY_SIGNING_SECRET and
// GATEWAY_BASE_URL; prints the status on stderr and the body on stdout.
import { readFile } from 'node:fs/promises';
import { signRequest, stringToSign, sha256Hex } from '../client/index.ts';
import { normalizeBaseURL, pathRelativeTo, urlUnder } from '../client/signing.ts';
import type { Config } from '../config.ts';
import { CommandError, whyNotConnected, type CommandLineIo } from './output.ts';
import { parse, UsageError } from './args.ts';

interface RequestCommand {
  method: string;
  path: string;
  /** JSON text, `-` for standard input, or `@file`. */
  body: string | undefined;
  verbose: boolean;
}

async function requestCommand(
  client: Config['client'],
  command: RequestCommand,
  print: { out: (text: string) => void; err: (text: string) => void },
): Promise<boolean> {
  const { apiKey, signingSecret, baseUrl } = client;
  if (!apiKey || !signingSecret) {
    throw new CommandError('Set GATEWAY_API_KEY and GATEWAY_SIGNING_SECRET to the key and signing secret to call with.');
  }
  if (!command.path.startsWith('/')) {
    throw new CommandError('The path is relative to the base URL and begins with /, e.g. /v1/chat/completions.');
  }
  const method = command.method.toUpperCase();
  // Sent and signed as the client library sends and signs its calls: the path as the URL parser
  // encodes and resolves it, relative to the base URL (whose trailing /v1 is ignored).
  const { url, path } = target(baseUrl, command.path);
  const body = await readBody(command.body);
  const signed = await signRequest({ signingSecret, method, path, body });
  if (command.verbose) {
    const lines = stringToSign({
      timestamp: signed.timestamp,
      nonce: signed.nonce,
      method,
      path,
      bodySha256: await sha256Hex(body),
    });
    print.err(`> ${method} ${url.href}\n> string to sign:\n${indent(lines)}\n> Svc-Signature: ${signed.header}`);
  }
  let request: Request;
  try {
    request = new Request(url.href, {
      method,
      headers: {
        authorization: `Bearer ${apiKey}`,
        'svc-signature': signed.header,
        ...(body === undefined ? {} : { 'content-type': 'application/json' }),
      },
      ...(body === undefined ? {} : { body }),
    });
  } catch (error) {
    // What fetch refuses before it connects: a method it does not send (CONNECT, one with a
    // space), a body with GET or HEAD, a key that a header cannot carry (whose message names it).
    const why = (error as Error).message.replaceAll(apiKey, '<GATEWAY_API_KEY>');
    throw new CommandError(`Cannot send ${method} ${command.path}: ${why}`);
  }
  let response: Response;
  let text: string;
  try {
    response = await fetch(request);
    text = await response.text();
  } catch (error) {
    throw new CommandError(`No answer from ${url.origin}: ${whyNotConnected(error)}.`);
  }
  const replayed = response.headers.get('idempotent-replayed');
  print.err(`HTTP ${response.status}${replayed ? ' (Idempotent-Replayed)' : ''}`);
  print.out(pretty(text));
  return response.ok;
}

/** The URL `path` names under the base URL, and the path and query of it that are signed. */
function target(baseUrl: string, path: string): { url: URL; path: string } {
  try {
    const base = normalizeBaseURL(baseUrl);
    const url = urlUnder(base, path);
    return { url, path: pathRelativeTo(url, base) };
  } catch (error) {
    // A base URL that is not http(s) or carries credentials, or a path that leads out of it
    // (`//host/...`, or `..` above the base URL's own path).
    throw new CommandError(`Cannot call ${path} on ${withoutCredentials(baseUrl)}: ${(error as Error).message}`);
  }
}

/** The URL as a message may quote it: without the user name and password it may carry. */
function withoutCredentials(text: string): string {
  const url = URL.parse(text);
  if (url === null || (url.username === '' && url.password === '')) return text;
  url.username = '';
  url.password = '';
  return url.href;
}

async function readBody(body: string | undefined): Promise<string | undefined> {
  if (body === undefined) return undefined;
  if (body === '-') {
    const chunks: Buffer[] = [];
    for await (const chunk of process.stdin) chunks.push(chunk as Buffer);
    return Buffer.concat(chunks).toString('utf8');
  }
  if (body.startsWith('@')) {
    try {
      return await readFile(body.slice(1), 'utf8');
    } catch (error) {
      throw new CommandError(`Cannot read the body from ${body.slice(1)}: ${(error as Error).message}`);
    }
  }
  return body;
}

function pretty(text: string): string {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

const indent = (text: string) => text.split('\n').map((line) => `    ${line}`).join('\n');

/** gateway request <METHOD> <path> [body] [--verbose], from its arguments; true when the answer is a success. */
export async function runRequestCommand(config: Config, args: string[], io: Pick<CommandLineIo, 'out' | 'err'>): Promise<boolean> {
  const { values, positionals } = parse(args, { verbose: { type: 'boolean', default: false } }, true);
  const [method, path, body] = positionals;
  if (method === undefined || path === undefined || positionals.length > 3) {
    throw new UsageError('request needs a method and a path, and takes an optional body.');
  }
  return requestCommand(config.client, { method, path, body, verbose: values.verbose! }, io);
}
