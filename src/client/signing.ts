// Request signing (docs/signing.md), with Web Crypto only so the library needs no
// dependency and runs wherever fetch does:
//
//   Svc-Signature: t=<unix seconds>,n=<nonce>,v1=<hex HMAC-SHA256 of the six lines below>
//
//   v1\n<t>\n<n>\n<METHOD>\n<path and query from /v1/>\n<hex SHA-256 of the body bytes>

export const SIGNATURE_HEADER = 'Svc-Signature';

export interface SignRequestInput {
  /** `svc_sig_...`; its UTF-8 bytes, prefix included, are the HMAC key. */
  signingSecret: string;
  method: string;
  /** Path and query relative to the gateway's base URL, exactly as sent: `/v1/...`. */
  path: string;
  /** The exact body bytes (a string is taken as UTF-8); none for a request without a body. */
  body?: string | Uint8Array | ArrayBuffer | null | undefined;
  /** Unix seconds; now by default. */
  timestamp?: number;
  /** Default: a fresh random nonce. Never reuse one: the server refuses a replayed POST. */
  nonce?: string;
}

export interface RequestSignature {
  /** The value of the Svc-Signature header. */
  header: string;
  timestamp: number;
  nonce: string;
  /** The v1 HMAC, lowercase hex. */
  signature: string;
}

/**
 * Signs one request. Signs what it is given: the client always passes a fresh timestamp and
 * nonce, and tests of the server may pass odd ones on purpose.
 */
export async function signRequest(input: SignRequestInput): Promise<RequestSignature> {
  const timestamp = input.timestamp ?? Math.floor(Date.now() / 1000);
  const nonce = input.nonce ?? createNonce();
  if (!Number.isSafeInteger(timestamp)) throw new TypeError('The signature timestamp must be a whole number of seconds.');
  if (/[\s,=]/.test(nonce)) throw new TypeError('A nonce cannot hold whitespace, commas or equals signs.');
  const payload = stringToSign({
    timestamp,
    nonce,
    method: input.method,
    path: input.path,
    bodySha256: await sha256Hex(input.body),
  });
  const key = await crypto.subtle.importKey(
    'raw',
    utf8.encode(input.signingSecret),
    { name: 'HMAC', hash: 'SHA-256' },
    false,
    ['sign'],
  );
  const signature = toHex(await crypto.subtle.sign('HMAC', key, utf8.encode(payload)));
  return { header: `t=${timestamp},n=${nonce},v1=${signature}`, timestamp, nonce, signature };
}

/**
 * The six lines that are signed, joined by \n (shown by debugging tools; signRequest and the
 * gateway's check use it). `timestamp` is t as the header carries it: the gateway passes the
 * digits it received, so a t sent with a leading zero is checked against those very digits.
 */
export function stringToSign(parts: {
  timestamp: number | string;
  nonce: string;
  method: string;
  path: string;
  bodySha256: string;
}): string {
  return ['v1', String(parts.timestamp), parts.nonce, parts.method.toUpperCase(), parts.path, parts.bodySha256].join('\n');
}

/** Lowercase hex SHA-256 of the body bytes; of the empty string when there is no body. */
export async function sha256Hex(body: string | Uint8Array | ArrayBuffer | null | undefined): Promise<string> {
  const bytes = body == null ? new Uint8Array(0) : typeof body === 'string' ? utf8.encode(body) : new Uint8Array(body);
  return toHex(await crypto.subtle.digest('SHA-256', bytes));
}

const NONCE_ALPHABET = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_';

/** 32 characters of [A-Za-z0-9_-]: 192 random bits (64 symbols, so every byte maps without bias). */
export function createNonce(): string {
  let nonce = '';
  for (const byte of crypto.getRandomValues(new Uint8Array(32))) nonce += NONCE_ALPHABET[byte & 63];
  return nonce;
}

/**
 * The gateway's base URL as an origin and a path prefix. A trailing `/v1` is dropped, so the
 * base URL an OpenAI SDK is given (`http://host:8080/v1`) names the same gateway as `http://host:8080`.
 */
export function normalizeBaseURL(baseURL: string | URL): URL {
  const url = new URL(baseURL);
  if (url.protocol !== 'http:' && url.protocol !== 'https:') {
    throw new TypeError(`The base URL must be http or https, not ${url.protocol}`);
  }
  // fetch refuses every request to such a URL, with an error that quotes it, password and all.
  if (url.username !== '' || url.password !== '') {
    throw new TypeError('The base URL cannot carry a user name or password (fetch refuses such a URL): send credentials in headers.');
  }
  url.pathname = url.pathname.replace(/\/+$/, '').replace(/\/v1$/, '');
  url.search = '';
  url.hash = '';
  return url;
}

/**
 * The URL that `path` (path and query from the base URL, beginning with /) names under the base
 * URL, as fetch sends it: percent-encoded, `.` and `..` segments resolved. pathRelativeTo gives
 * the part of it that is signed.
 */
export function urlUnder(base: URL, path: string): URL {
  return new URL(base.pathname.replace(/\/$/, '') + path, base);
}

/** The path and query of `url` relative to the base URL: what the signature covers. */
export function pathRelativeTo(url: URL, base: URL): string {
  const prefix = base.pathname.replace(/\/+$/, '');
  const underBase = url.pathname === prefix || url.pathname.startsWith(`${prefix}/`);
  if (url.origin !== base.origin || !underBase) {
    throw new TypeError(`${url.origin}${url.pathname} is not under the gateway's base URL ${base.href}`);
  }
  return url.pathname.slice(prefix.length) + queryAsSent(url);
}

/**
 * The query of `url` as fetch sends it, `?` included. `url.search` is '' for an empty query,
 * but the URL keeps its `?` (`/v1/x?`), and fetch sends it. The first `?` of the href before
 * its `#` starts the query: neither can stand unencoded in the parts before it.
 */
function queryAsSent(url: URL): string {
  if (url.search !== '') return url.search;
  const href = url.href;
  const hash = href.indexOf('#');
  return (hash === -1 ? href : href.slice(0, hash)).includes('?') ? '?' : '';
}

const utf8 = new TextEncoder();

function toHex(buffer: ArrayBuffer): string {
  let hex = '';
  for (const byte of new Uint8Array(buffer)) hex += byte.toString(16).padStart(2, '0');
  return hex;
}
