// Signed requests for the load generator (docs/signing.md), built as raw HTTP/1.1 text.
// node:crypto's synchronous HMAC costs a few microseconds; the body's SHA-256 is computed once
// per distinct body. Nonces are a per-run random prefix and a counter: unique per key, which is
// all the contract asks of them, and far cheaper than fresh random bytes for every request.
import { createHash, createHmac, createSecretKey, randomBytes, type KeyObject } from 'node:crypto';
import { signRequest } from '../src/client/signing.ts';

export interface Credentials {
  apiKey: string;
  signingSecret: string;
}

export const sha256Hex = (body: string) => createHash('sha256').update(body, 'utf8').digest('hex');

export class RequestSigner {
  readonly #credentials: Credentials;
  readonly #host: string;
  readonly #secret: KeyObject;
  readonly #noncePrefix = `b${randomBytes(9).toString('base64url')}`;
  #counter = 0;

  constructor(credentials: Credentials, host: string) {
    this.#credentials = credentials;
    this.#host = host;
    // A KeyObject made once: createHmac with a Buffer key costs several times more per call.
    this.#secret = createSecretKey(Buffer.from(credentials.signingSecret, 'utf8'));
  }

  nextNonce(): string {
    return `${this.#noncePrefix}_${(this.#counter++).toString(36).padStart(6, '0')}`;
  }

  signature(method: string, path: string, bodySha256: string, timestamp: number, nonce: string): string {
    const hmac = createHmac('sha256', this.#secret)
      .update(`v1\n${timestamp}\n${nonce}\n${method}\n${path}\n${bodySha256}`)
      .digest('hex');
    return `t=${timestamp},n=${nonce},v1=${hmac}`;
  }

  /** A complete POST of a JSON body, signed now with a new nonce. `bodySha256` is sha256Hex(body). */
  post(path: string, body: string, bodySha256: string): string {
    const signature = this.signature('POST', path, bodySha256, Math.floor(Date.now() / 1000), this.nextNonce());
    return (
      `POST ${path} HTTP/1.1\r\nHost: ${this.#host}\r\nAuthorization: Bearer ${this.#credentials.apiKey}\r\n` +
      `Svc-Signature: ${signature}\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`
    );
  }

  /** A complete GET, signed now with a new nonce. */
  get(path: string): string {
    const signature = this.signature('GET', path, EMPTY_SHA256, Math.floor(Date.now() / 1000), this.nextNonce());
    return (
      `GET ${path} HTTP/1.1\r\nHost: ${this.#host}\r\nAuthorization: Bearer ${this.#credentials.apiKey}\r\n` +
      `Svc-Signature: ${signature}\r\n\r\n`
    );
  }

  /**
   * Checks that these signatures are the client library's (src/client/signing.ts, Web Crypto),
   * so that a refused request can only mean a gateway that refuses good signatures.
   */
  async assertMatchesClientLibrary(): Promise<void> {
    const body = '{"model":"test-echo","messages":[{"role":"user","content":"check"}]}';
    const timestamp = 1_800_000_000;
    const nonce = 'bench-self-check-nonce';
    const reference = await signRequest({
      signingSecret: this.#credentials.signingSecret,
      method: 'POST',
      path: '/v1/chat/completions',
      body,
      timestamp,
      nonce,
    });
    const ours = this.signature('POST', '/v1/chat/completions', sha256Hex(body), timestamp, nonce);
    if (ours !== reference.header) throw new Error(`bench signatures differ from the client library's: ${ours}`);
  }
}

const EMPTY_SHA256 = sha256Hex('');
