// Hostile requests for the property-based scenario: fast-check arbitraries describing a request
// (method, path and lookup id, query, bearer key, signature, content type, body, extra
// headers), resolved against the scenario's real keys and ids into the exact bytes to send, and
// a sender that sends them with node:http (which, unlike fetch, lets any Latin-1 header value
// and any method with any body through).
import http from 'node:http';
import fc from 'fast-check';
import type { CreatedKey } from '../../../src/keys/service.ts';
import { newNonce, signature } from '../../helpers/signing.ts';
import { privateContent } from './run.ts';

export type KeyName = 'a' | 'live' | 'b' | 'revoked';

/** The scenario's world, which generated descriptions are resolved against. */
export interface World {
  keys: Record<KeyName, CreatedKey>;
  /** Ids of requests stored for each key (its project and mode). */
  ids: Record<KeyName, string[]>;
  /** Nonces of POSTs accepted so far, per key, for replays. */
  acceptedNonces: Record<KeyName, string[]>;
  maxBodyBytes: number;
}

type Auth =
  | { kind: 'none' }
  | { kind: 'raw'; value: string }
  | { kind: 'bearer'; token: Token }
  | { kind: 'key'; key: KeyName; style: string; suffix: string };

type Token =
  | { kind: 'text'; text: string }
  | { kind: 'prefixed'; prefix: string; rest: string }
  | { kind: 'mutated'; key: KeyName; at: number; char: string }
  | { kind: 'truncated'; key: KeyName; length: number }
  | { kind: 'extended'; key: KeyName; extra: string }
  | { kind: 'secret-as-key'; key: KeyName };

type Signature =
  | { kind: 'none' }
  | { kind: 'raw'; value: string }
  | {
      kind: 'signed';
      secret: 'own' | 'other';
      skewSeconds: number;
      nonce: 'fresh' | 'replay' | 'short' | 'long' | 'bad-chars';
      tamper: 'none' | 'method' | 'path' | 'body' | 'uppercase-hex' | 'truncated-hex' | 'extra-field' | 'spaces' | 'reordered';
    };

type Path =
  | { kind: 'completions'; spelling: string }
  | { kind: 'lookup'; id: Id }
  | { kind: 'raw'; path: string };

type Id =
  | { kind: 'stored'; key: KeyName; index: number }
  | { kind: 'text'; text: string; encode: boolean };

type Body =
  | { kind: 'none' }
  | { kind: 'completion'; fields: Record<string, unknown>; mutation: Mutation }
  | { kind: 'json'; value: unknown }
  | { kind: 'text'; text: string }
  | { kind: 'bytes'; bytes: Uint8Array }
  | { kind: 'literal'; text: string }
  | { kind: 'deep'; depth: number; open: string; close: string }
  | { kind: 'too-large'; extra: number };

type Mutation =
  | { kind: 'none' }
  | { kind: 'set'; field: string; value: unknown }
  | { kind: 'delete'; field: string }
  | { kind: 'message'; set: string; value: unknown }
  | { kind: 'messages'; value: unknown };

export interface Hostile {
  method: string;
  path: Path;
  query: string;
  auth: Auth;
  signature: Signature;
  contentType: string | undefined;
  body: Body;
  headers: [string, string | string[]][];
}

/** What a description resolves to: the request to send, and what it is known to be. */
export interface Resolved {
  method: string;
  /** Path and query as sent. */
  target: string;
  headers: Record<string, string | string[]>;
  body: Buffer | undefined;
  /** The key it authenticates with, when the Authorization header carries an active key. */
  key: KeyName | undefined;
  /** Its Svc-Signature may be accepted: correct for what is sent, with the key's own secret, a well-formed nonce and a current time. */
  correctlySigned: boolean;
  /** A POST whose nonce was already accepted for its key: it must be refused. */
  replayedPost: boolean;
  /** The nonce of its signature, if it has one that could be recorded. */
  nonce: string | undefined;
  route: 'completions' | 'lookup' | 'other';
  /** For lookups of a stored request: whose it is. */
  lookupOwner: KeyName | undefined;
}

const KEY_NAMES: KeyName[] = ['a', 'live', 'b', 'revoked'];
const ACTIVE: KeyName[] = ['a', 'live', 'b'];

/** Header values Node's HTTP client will send: Latin-1, no CR, LF or NUL. */
const headerValue = fc.string({
  unit: fc.oneof(
    { weight: 4, arbitrary: fc.integer({ min: 0x20, max: 0x7e }).map((code) => String.fromCharCode(code)) },
    { weight: 1, arbitrary: fc.integer({ min: 0x80, max: 0xff }).map((code) => String.fromCharCode(code)) },
    { weight: 1, arbitrary: fc.constant('\t') },
  ),
  maxLength: 80,
});
const tokenChars = fc.string({ unit: fc.constantFrom(...'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&\'*+-.^_`|~'), minLength: 1, maxLength: 20 });
const base62 = (maxLength: number) => fc.string({ unit: fc.constantFrom(...'0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz'), maxLength });
/** Any text, written out as the Latin-1 characters of its UTF-8 bytes (what a header carries). */
const latin1OfUtf8 = (text: string) => Buffer.from(text, 'utf8').toString('latin1').replace(/[\r\n\0]/g, '');

const token: fc.Arbitrary<Token> = fc.oneof(
  fc.record({ kind: fc.constant('text'), text: fc.string({ maxLength: 60 }).map(latin1OfUtf8) }),
  fc.record({ kind: fc.constant('prefixed'), prefix: fc.constantFrom('svc_test_', 'svc_live_', 'svc_sig_', 'svc_', 'sk-', 'SVC_TEST_'), rest: base62(60) }),
  fc.record({ kind: fc.constant('mutated'), key: fc.constantFrom(...ACTIVE), at: fc.nat(), char: fc.constantFrom(...'aZ09_-') }),
  fc.record({ kind: fc.constant('truncated'), key: fc.constantFrom(...ACTIVE), length: fc.nat(60) }),
  fc.record({ kind: fc.constant('extended'), key: fc.constantFrom(...ACTIVE), extra: fc.string({ minLength: 1, maxLength: 5 }).map(latin1OfUtf8).filter((extra) => extra.trim() !== '') }),
  fc.record({ kind: fc.constant('secret-as-key'), key: fc.constantFrom(...ACTIVE) }),
);

const auth: fc.Arbitrary<Auth> = fc.oneof(
  { weight: 1, arbitrary: fc.constant({ kind: 'none' as const }) },
  { weight: 1, arbitrary: fc.record({ kind: fc.constant('raw' as const), value: headerValue }) },
  { weight: 2, arbitrary: fc.record({ kind: fc.constant('bearer' as const), token }) },
  {
    weight: 6,
    arbitrary: fc.record({
      kind: fc.constant('key' as const),
      key: fc.constantFrom<KeyName>('a', 'a', 'a', 'live', 'b', 'revoked'),
      style: fc.constantFrom('Bearer ', 'Bearer ', 'Bearer ', 'bearer ', 'BEARER   ', 'Bearer', 'Basic ', 'Token ', ''),
      suffix: fc.constantFrom('', '', '', ' ', 'x', ','),
    }),
  },
);

const signatureArbitrary: fc.Arbitrary<Signature> = fc.oneof(
  { weight: 1, arbitrary: fc.constant({ kind: 'none' as const }) },
  {
    weight: 1,
    arbitrary: fc.record({
      kind: fc.constant('raw' as const),
      value: fc.oneof(headerValue, fc.stringMatching(/^t=\d{1,12},n=[A-Za-z0-9_-]{10,70},v1=[0-9a-fA-F]{60,66}$/)),
    }),
  },
  {
    weight: 6,
    arbitrary: fc.record({
      kind: fc.constant('signed' as const),
      secret: fc.constantFrom<'own' | 'other'>('own', 'own', 'own', 'other'),
      skewSeconds: fc.oneof(
        { weight: 4, arbitrary: fc.integer({ min: -30, max: 30 }) },
        // Around the 300 s window, but not just inside its past edge: a nonce accepted there
        // would expire, and be deleted by the cleanup task, while the scenario counts rows.
        { weight: 1, arbitrary: fc.oneof(fc.integer({ min: -400, max: -301 }), fc.integer({ min: -119, max: 400 })) },
        { weight: 1, arbitrary: fc.integer({ min: -10_000_000, max: 10_000_000 }) },
      ),
      nonce: fc.constantFrom<'fresh' | 'replay' | 'short' | 'long' | 'bad-chars'>('fresh', 'fresh', 'fresh', 'replay', 'short', 'long', 'bad-chars'),
      tamper: fc.constantFrom<'none' | 'method' | 'path' | 'body' | 'uppercase-hex' | 'truncated-hex' | 'extra-field' | 'spaces' | 'reordered'>(
        'none', 'none', 'none', 'none', 'method', 'path', 'body', 'uppercase-hex', 'truncated-hex', 'extra-field', 'spaces', 'reordered',
      ),
    }),
  },
);

const idArbitrary: fc.Arbitrary<Id> = fc.oneof(
  { weight: 3, arbitrary: fc.record({ kind: fc.constant('stored' as const), key: fc.constantFrom(...KEY_NAMES), index: fc.nat() }) },
  {
    weight: 4,
    arbitrary: fc.record({
      kind: fc.constant('text' as const),
      text: fc.oneof(
        base62(50).map((rest) => `req_${rest}`),
        fc.string({ maxLength: 40 }),
        fc.string({ unit: 'binary', maxLength: 40 }),
        fc.constantFrom('', '..', '.', '%', '%zz', '%E0%A4%A', '%00', '%2e%2e', '%2F', 'req_%00', 'chatcmpl-abc', 'req_' + 'A'.repeat(5000), '\u0000', 'null', 'undefined', '[object Object]', "' or 1=1 --"),
      ),
      encode: fc.boolean(),
    }),
  },
);

const pathArbitrary: fc.Arbitrary<Path> = fc.oneof(
  {
    weight: 5,
    arbitrary: fc.record({
      kind: fc.constant('completions' as const),
      spelling: fc.constantFrom('/v1/chat/completions', '/v1/chat/completions', '/v1/chat/completions', '/v1/chat/completions/', '/V1/chat/completions', '/v1/chat//completions', '/v1/chat/completions%20', '/v1/chat/./completions'),
    }),
  },
  { weight: 4, arbitrary: fc.record({ kind: fc.constant('lookup' as const), id: idArbitrary }) },
  {
    weight: 1,
    arbitrary: fc.record({
      kind: fc.constant('raw' as const),
      path: fc.oneof(
        fc.constantFrom('/', '/v1', '/v1/', '/v1/requests', '/v1/requests/', '/v2/chat/completions', '/healthz', '/readyz', '//v1/requests/x', '/v1/../v1/requests/x', '/favicon.ico'),
        fc.string({ unit: fc.integer({ min: 0x21, max: 0xff }).map((code) => String.fromCharCode(code)), maxLength: 60 }).map((path) => `/${path}`),
      ),
    }),
  },
);

/** Bodies built on a valid completion request, with one thing changed. */
const mutation: fc.Arbitrary<Mutation> = fc.oneof(
  { weight: 2, arbitrary: fc.constant({ kind: 'none' as const }) },
  {
    weight: 4,
    arbitrary: fc.record({
      kind: fc.constant('set' as const),
      field: fc.constantFrom('model', 'messages', 'temperature', 'top_p', 'presence_penalty', 'frequency_penalty', 'max_tokens', 'wait', 'idempotency_key', 'stream', 'n', 'tools', '__proto__', 'constructor', 'user', ''),
      value: fc.oneof(
        fc.jsonValue({ maxDepth: 3 }),
        fc.constantFrom(-1, 0, 1, 2, 2.0000001, -2.5, 1e308, -0, 0.5, 2 ** 53, 1.5, true, false, null, '', 'test-echo', [], {}, 'x'.repeat(300)),
      ),
    }),
  },
  { weight: 1, arbitrary: fc.record({ kind: fc.constant('delete' as const), field: fc.constantFrom('model', 'messages') }) },
  {
    weight: 2,
    arbitrary: fc.record({
      kind: fc.constant('message' as const),
      set: fc.constantFrom('role', 'content', 'name', 'tool_calls', ''),
      value: fc.oneof(fc.jsonValue({ maxDepth: 2 }), fc.constantFrom('system', 'developer', 'user', 'assistant', 'tool', 'function', 'User', '')),
    }),
  },
  { weight: 1, arbitrary: fc.record({ kind: fc.constant('messages' as const), value: fc.oneof(fc.jsonValue({ maxDepth: 3 }), fc.constant([])) }) },
);

const completionFields = fc.record(
  {
    temperature: fc.double({ min: 0, max: 2, noNaN: true }),
    top_p: fc.double({ min: 0, max: 1, noNaN: true }),
    max_tokens: fc.integer({ min: 1, max: 4096 }),
    wait: fc.boolean(),
    idempotency_key: fc.stringMatching(/^[\x20-\x7e]{1,40}$/),
    stream: fc.constant(false),
  },
  { requiredKeys: [] },
);

const bodyArbitrary: fc.Arbitrary<Body> = fc.oneof(
  { weight: 2, arbitrary: fc.constant({ kind: 'none' as const }) },
  { weight: 8, arbitrary: fc.record({ kind: fc.constant('completion' as const), fields: completionFields, mutation }) },
  { weight: 2, arbitrary: fc.record({ kind: fc.constant('json' as const), value: fc.jsonValue({ maxDepth: 4 }) }) },
  { weight: 1, arbitrary: fc.record({ kind: fc.constant('text' as const), text: fc.string({ maxLength: 200 }) }) },
  { weight: 1, arbitrary: fc.record({ kind: fc.constant('bytes' as const), bytes: fc.uint8Array({ maxLength: 200 }) }) },
  {
    weight: 2,
    arbitrary: fc.record({
      kind: fc.constant('literal' as const),
      text: fc.constantFrom(
        '{"model":"test-echo","model":"x","messages":[{"role":"user","content":"hi"}]}',
        '{"__proto__":{"polluted":true},"model":"test-echo","messages":[{"role":"user","content":"hi"}]}',
        '{"constructor":{"prototype":{"polluted":true}},"model":"test-echo","messages":[{"role":"user","content":"hi"}]}',
        '{"model":"test-echo","messages":[{"role":"user","content":"\\ud800"}]}',
        '{"model":"test-echo","messages":[{"role":"user","content":"\\u0000"}]}',
        '{"model":"test-echo","messages":[{"role":"user","content":"hi"}],"max_tokens":1e999}',
        '{"model":"test-echo","messages":[{"role":"user","content":"hi"}],"temperature":-0}',
        '{"model":"test-echo","messages":[{"role":"user","content":"hi"}],"stream":true}',
        '{"model":"test-echo","messages":[{"role":"user","content":"hi"}],"stream":"false"}',
        '{"model":"test-echo","messages":[{"role":"user","content":"hi"}]',
        '{"model":"test-echo","messages":[{"role":"user","content":"hi"}]}garbage',
        '\ufeff{"model":"test-echo","messages":[{"role":"user","content":"hi"}]}',
        '{"model":"test-echo","messages":[' + '{"role":"user","content":"x"},'.repeat(2048) + '{"role":"user","content":"x"}]}',
        'null', 'true', '0', '""', '[]', '{}', '',
      ),
    }),
  },
  {
    weight: 1,
    arbitrary: fc.record({
      kind: fc.constant('deep' as const),
      depth: fc.integer({ min: 100, max: 5_000 }),
      open: fc.constantFrom('[', '{"a":', '{"messages":'),
      close: fc.constantFrom(']', '}'),
    }),
  },
  { weight: 1, arbitrary: fc.record({ kind: fc.constant('too-large' as const), extra: fc.integer({ min: 1, max: 20_000 }) }) },
);

const contentType = fc.option(
  fc.oneof(
    { weight: 6, arbitrary: fc.constantFrom('application/json', 'application/json', 'application/json; charset=utf-8', 'application/json; charset=UTF-8', 'Application/JSON') },
    {
      weight: 3,
      arbitrary: fc.constantFrom(
        'application/json; charset=latin1', 'application/json; charset=utf-16', 'text/plain', 'text/json', 'application/x-www-form-urlencoded',
        'multipart/form-data; boundary=x', 'application/jsonx', 'application/*', '*/*', '', 'application/json, text/plain', 'application/json;;;',
      ),
    },
    { weight: 1, arbitrary: headerValue },
  ),
  { nil: undefined, freq: 8 },
);

const extraHeaders = fc.array(
  fc.oneof(
    fc.tuple(tokenChars.filter((name) => !['content-length', 'transfer-encoding', 'connection', 'expect', 'upgrade', 'trailer', 'te', 'keep-alive'].includes(name.toLowerCase())), headerValue),
    fc.tuple(fc.constantFrom('content-encoding'), fc.constantFrom('gzip', 'identity', 'br', 'x')),
    fc.tuple(fc.constantFrom('authorization', 'svc-signature', 'content-type'), fc.array(headerValue, { minLength: 2, maxLength: 3 })),
    fc.tuple(fc.constantFrom('x-large'), fc.integer({ min: 1_000, max: 20_000 }).map((size) => 'x'.repeat(size))),
    fc.tuple(fc.constantFrom('host', 'x-forwarded-for', 'idempotent-replayed', 'accept', 'accept-encoding'), headerValue),
  ),
  { maxLength: 4 },
);

const wild: fc.Arbitrary<Hostile> = fc.record({
  method: fc.constantFrom('POST', 'POST', 'POST', 'POST', 'GET', 'GET', 'GET', 'PUT', 'DELETE', 'PATCH', 'OPTIONS'),
  path: pathArbitrary,
  query: fc.oneof(
    { weight: 6, arbitrary: fc.constant('') },
    { weight: 1, arbitrary: fc.constantFrom('?', '?wait=true', '?a=1&a=2', '?%zz', '?x=' + 'y'.repeat(2000)) },
    { weight: 1, arbitrary: fc.string({ unit: fc.integer({ min: 0x21, max: 0xff }).map((code) => String.fromCharCode(code)), maxLength: 40 }).map((query) => `?${query.replace(/#/g, '')}`) },
  ),
  auth,
  signature: signatureArbitrary,
  contentType,
  body: bodyArbitrary,
  headers: extraHeaders,
});

/** A request that would be accepted: a signed POST of a valid body, or a signed lookup of one's own request. */
const valid: fc.Arbitrary<Hostile> = fc.record({
  key: fc.constantFrom<KeyName>('a', 'a', 'live', 'b'),
  post: fc.boolean(),
  index: fc.nat(),
  fields: completionFields,
}).map(({ key, post, index, fields }) => ({
  method: post ? 'POST' : 'GET',
  path: post ? { kind: 'completions' as const, spelling: '/v1/chat/completions' } : { kind: 'lookup' as const, id: { kind: 'stored' as const, key, index } },
  query: '',
  auth: { kind: 'key' as const, key, style: 'Bearer ', suffix: '' },
  signature: { kind: 'signed' as const, secret: 'own' as const, skewSeconds: 0, nonce: 'fresh' as const, tamper: 'none' as const },
  contentType: post ? 'application/json' : undefined,
  body: post ? { kind: 'completion' as const, fields, mutation: { kind: 'none' as const } } : { kind: 'none' as const },
  headers: [],
}));

const PARTS = ['method', 'path', 'query', 'auth', 'signature', 'contentType', 'body', 'headers'] as const;

/**
 * Hostile requests: a third are wild in every part; the rest are valid requests with none, one
 * or two parts replaced by wild ones, so that most get far into the gateway before being refused.
 */
export const hostileRequest: fc.Arbitrary<Hostile> = fc.oneof(
  { weight: 1, arbitrary: wild },
  {
    weight: 2,
    arbitrary: fc
      .record({
        base: valid,
        wild,
        spoiled: fc.oneof(
          { weight: 1, arbitrary: fc.constant([] as (typeof PARTS)[number][]) },
          { weight: 3, arbitrary: fc.subarray([...PARTS], { minLength: 1, maxLength: 1 }) },
          { weight: 2, arbitrary: fc.subarray([...PARTS], { minLength: 2, maxLength: 2 }) },
        ),
      })
      .map(({ base, wild, spoiled }) => {
        const request: Hostile = { ...base };
        for (const part of spoiled) Object.assign(request, { [part]: wild[part] });
        return request;
      }),
  },
);

/** Turns a description into the request to send, using the world's keys, ids and nonces. */
export function resolve(hostile: Hostile, world: World): Resolved {
  const headers: Record<string, string | string[]> = {};
  let key: KeyName | undefined;
  let bearerKey: KeyName | undefined;
  const apiKey = (name: KeyName) => world.keys[name].api_key;

  switch (hostile.auth.kind) {
    case 'none':
      break;
    case 'raw':
      headers.authorization = hostile.auth.value;
      break;
    case 'bearer': {
      const token = hostile.auth.token;
      let text: string;
      switch (token.kind) {
        case 'text':
          text = token.text;
          break;
        case 'prefixed':
          text = token.prefix + token.rest;
          break;
        case 'mutated': {
          const original = apiKey(token.key);
          const at = 9 + (token.at % (original.length - 9));
          const char = original[at] === token.char ? (token.char === 'a' ? 'b' : 'a') : token.char;
          text = original.slice(0, at) + char + original.slice(at + 1);
          break;
        }
        case 'truncated':
          text = apiKey(token.key).slice(0, Math.min(token.length, apiKey(token.key).length - 1));
          break;
        case 'extended':
          text = apiKey(token.key) + token.extra;
          break;
        case 'secret-as-key':
          text = world.keys[token.key].signing_secret;
          break;
      }
      headers.authorization = `Bearer ${text}`;
      break;
    }
    case 'key': {
      bearerKey = hostile.auth.key;
      headers.authorization = `${hostile.auth.style}${apiKey(hostile.auth.key)}${hostile.auth.suffix}`;
      const wellFormed = /^bearer +$/i.test(hostile.auth.style) && (hostile.auth.suffix === '' || hostile.auth.suffix === ' ');
      if (wellFormed && hostile.auth.key !== 'revoked') key = hostile.auth.key;
      break;
    }
  }

  let path: string;
  let route: Resolved['route'] = 'other';
  let lookupOwner: KeyName | undefined;
  switch (hostile.path.kind) {
    case 'completions':
      path = hostile.path.spelling;
      if (path === '/v1/chat/completions') route = 'completions';
      break;
    case 'lookup': {
      const id = hostile.path.id;
      let segment: string;
      if (id.kind === 'stored') {
        const ids = world.ids[id.key];
        segment = ids[id.index % ids.length]!;
        lookupOwner = id.key === 'revoked' ? 'a' : id.key;
      } else {
        segment = id.encode ? encodeURIComponent(id.text.replace(/[\ud800-\udfff]/g, '')) : latin1Path(id.text);
      }
      path = `/v1/requests/${segment}`;
      // Only a single, non-empty path segment is a lookup; anything else is another route.
      if (segment !== '' && !/[/?]/.test(segment)) route = 'lookup';
      break;
    }
    case 'raw':
      path = latin1Path(hostile.path.path);
      break;
  }
  const target = path + latin1Path(hostile.query);

  const body = bodyBytes(hostile.body, world.maxBodyBytes);
  if (hostile.contentType !== undefined) headers['content-type'] = hostile.contentType;

  let correctlySigned = false;
  let replayedPost = false;
  let nonce: string | undefined;
  const sig = hostile.signature;
  if (sig.kind === 'raw') headers['svc-signature'] = sig.value;
  if (sig.kind === 'signed') {
    const signer = bearerKey ?? 'a';
    const secretOf = sig.secret === 'own' ? signer : signer === 'a' ? 'b' : 'a';
    const replayable = world.acceptedNonces[signer];
    nonce =
      sig.nonce === 'replay' && replayable.length > 0
        ? replayable[Math.abs(sig.skewSeconds) % replayable.length]!
        : sig.nonce === 'short'
          ? newNonce().slice(0, 15)
          : sig.nonce === 'long'
            ? (newNonce() + newNonce() + newNonce()).slice(0, 65)
            : sig.nonce === 'bad-chars'
              ? `${newNonce().slice(0, 20)}.+/`
              : newNonce();
    const timestamp = Math.floor(Date.now() / 1000) + sig.skewSeconds;
    const signed = {
      secret: world.keys[secretOf].signing_secret,
      method: sig.tamper === 'method' ? (hostile.method === 'GET' ? 'POST' : 'GET') : hostile.method,
      path: sig.tamper === 'path' ? `${target}x` : target,
      body: sig.tamper === 'body' ? Buffer.concat([body ?? Buffer.alloc(0), Buffer.from(' ')]) : (body ?? Buffer.alloc(0)),
      timestamp,
      nonce,
    };
    const original = signature(signed);
    let header = original;
    if (sig.tamper === 'uppercase-hex') header = header.replace(/v1=([0-9a-f]+)/, (_, hex: string) => `v1=${hex.toUpperCase()}`);
    if (sig.tamper === 'truncated-hex') header = header.slice(0, -2);
    if (sig.tamper === 'extra-field') header = `${header},v2=abc`;
    if (sig.tamper === 'spaces') header = header.replaceAll(',', ', ');
    if (sig.tamper === 'reordered') header = header.split(',').reverse().join(',');
    headers['svc-signature'] = header;
    // A signature the server may accept (it reads a body only on a POST, so a signature over the
    // body of any other request cannot match): its own secret, its time within the window (give or
    // take the second it takes to arrive), a well-formed nonce, nothing changed after signing.
    const untampered = sig.tamper === 'none' || (sig.tamper === 'uppercase-hex' && !/[a-f]/.test(original.split('v1=')[1] ?? ''));
    correctlySigned = sig.secret === 'own' && Math.abs(sig.skewSeconds) <= 302 && (hostile.method === 'POST' || body === undefined || body.length === 0) && (sig.nonce === 'fresh' || sig.nonce === 'replay') && untampered && bearerKey !== undefined;
    replayedPost = hostile.method === 'POST' && sig.nonce === 'replay' && replayable.length > 0;
  }

  for (const [name, value] of hostile.headers) {
    const lower = name.toLowerCase();
    const existing = headers[lower];
    if (existing === undefined || lower === 'host') {
      headers[lower] = value;
      continue;
    }
    // Sent twice. Node keeps the first Authorization and Content-Type and joins the values of
    // other headers, so a second Svc-Signature spoils the first.
    headers[lower] = [...(Array.isArray(existing) ? existing : [existing]), ...(Array.isArray(value) ? value : [value])];
    if (lower === 'svc-signature') correctlySigned = false;
  }
  return { method: hostile.method, target, headers, body, key, correctlySigned, replayedPost, nonce, route, lookupOwner };
}

/** A path as Node's client will send it: characters 0x21 to 0xff, nothing after a '#'. */
function latin1Path(text: string): string {
  return Buffer.from(text, 'utf8').toString('latin1').replace(/[^\x21-\xff]/g, (char) => encodeURIComponent(char)).replace(/#/g, '%23');
}

function bodyBytes(body: Body, maxBodyBytes: number): Buffer | undefined {
  switch (body.kind) {
    case 'none':
      return undefined;
    case 'completion': {
      const request: Record<string, unknown> = {
        model: 'test-echo',
        messages: [{ role: 'user', content: privateContent('scenario 5') }],
        ...body.fields,
      };
      const mutation = body.mutation;
      if (mutation.kind === 'set') Object.defineProperty(request, mutation.field, { value: mutation.value, enumerable: true, writable: true, configurable: true });
      if (mutation.kind === 'delete') delete request[mutation.field];
      if (mutation.kind === 'message') {
        Object.defineProperty((request.messages as object[])[0]!, mutation.set, { value: mutation.value, enumerable: true, writable: true, configurable: true });
      }
      if (mutation.kind === 'messages') request.messages = mutation.value;
      return Buffer.from(JSON.stringify(request));
    }
    case 'json':
      return Buffer.from(JSON.stringify(body.value) ?? 'null');
    case 'text':
      return Buffer.from(body.text);
    case 'bytes':
      return Buffer.from(body.bytes);
    case 'literal':
      return Buffer.from(body.text);
    case 'deep':
      return Buffer.from(body.open.repeat(body.depth) + '1' + body.close.repeat(body.depth));
    case 'too-large': {
      const filler = 'x'.repeat(maxBodyBytes + body.extra);
      return Buffer.from(JSON.stringify({ model: 'test-echo', messages: [{ role: 'user', content: filler }] }));
    }
  }
}

export interface RawAnswer {
  status: number;
  headers: Headers;
  text: string;
  body: unknown;
  /** Why no answer came (status 0). */
  failure: string | undefined;
}

/** Sends a resolved request over a kept-alive connection; never throws. */
export function sendResolved(agent: http.Agent, baseUrl: string, request: Resolved, timeoutMs = 10_000): Promise<RawAnswer> {
  const url = new URL(baseUrl);
  return new Promise((resolve) => {
    let done = false;
    const finish = (answer: RawAnswer) => {
      if (!done) {
        done = true;
        resolve(answer);
      }
    };
    const failed = (failure: string) => finish({ status: 0, headers: new Headers(), text: '', body: undefined, failure });
    let outgoing: http.ClientRequest;
    try {
      outgoing = http.request({
        agent,
        host: url.hostname,
        port: url.port,
        method: request.method,
        path: request.target,
        headers: { ...request.headers, ...(request.body ? { 'content-length': String(request.body.length) } : {}) },
        timeout: timeoutMs,
      });
    } catch (error) {
      failed(`the client refused to send it: ${(error as Error).message}`);
      return;
    }
    outgoing.on('response', (response) => {
      const chunks: Buffer[] = [];
      response.on('data', (chunk: Buffer) => chunks.push(chunk));
      response.on('error', (error) => failed(`reading the answer: ${error.message}`));
      response.on('end', () => {
        const text = Buffer.concat(chunks).toString('utf8');
        let body: unknown = text;
        try {
          body = JSON.parse(text);
        } catch {}
        const headers = new Headers();
        for (const [name, value] of Object.entries(response.headers)) {
          if (value !== undefined) headers.set(name, Array.isArray(value) ? value.join(', ') : value);
        }
        finish({ status: response.statusCode ?? 0, headers, text, body, failure: undefined });
      });
    });
    outgoing.on('timeout', () => {
      outgoing.destroy();
      failed(`no answer within ${timeoutMs} ms`);
    });
    outgoing.on('error', (error: Error & { code?: string }) => failed(`${error.code ?? error.name}: ${error.message}`));
    outgoing.end(request.body);
  });
}
