// Identifiers and secrets, all written in base62 ([0-9A-Za-z], in ASCII order so that
// fixed-width encodings sort like the numbers they encode).
import { randomFillSync } from 'node:crypto';

const ALPHABET = '0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz';
// The largest multiple of 62 that fits in a byte: bytes at or above it are skipped so every
// character is equally likely.
const UNBIASED_LIMIT = 248;

// Random bytes are drawn from a pool refilled 4 KiB at a time: one call into the CSPRNG per
// hundred ids rather than one per id.
const pool = Buffer.alloc(4096);
let poolOffset = pool.length;

function randomByte(): number {
  if (poolOffset === pool.length) {
    randomFillSync(pool);
    poolOffset = 0;
  }
  return pool[poolOffset++]!;
}

/** `length` characters of base62, each carrying log2(62) ≈ 5.95 random bits. */
export function randomBase62(length: number): string {
  let out = '';
  while (out.length < length) {
    const byte = randomByte();
    if (byte < UNBIASED_LIMIT) out += ALPHABET[byte % 62];
  }
  return out;
}

function base62Fixed(value: number, width: number): string {
  let out = '';
  for (let rest = value; out.length < width; rest = Math.floor(rest / 62)) out = ALPHABET[rest % 62] + out;
  return out;
}

export const REQUEST_ID = /^req_[A-Za-z0-9]{20,40}$/;

/**
 * `req_` + 8 characters of milliseconds since 1970 (ordered until the year 8888) + 18 random
 * characters (107 bits), so ids sort by creation time and cannot be guessed.
 */
export function newRequestId(now = Date.now()): string {
  return `req_${base62Fixed(now, 8)}${randomBase62(18)}`;
}

/** The smallest id of a request created at `ms`: every request created earlier sorts below it. */
export function requestIdFloor(ms: number): string {
  return `req_${base62Fixed(ms, 8)}`;
}

export type KeyMode = 'live' | 'test';

export const API_KEY = /^svc_(live|test)_[A-Za-z0-9]{32,}$/;

export const newApiKey = (mode: KeyMode) => `svc_${mode}_${randomBase62(40)}`;
export const newSigningSecret = () => `svc_sig_${randomBase62(40)}`;
export const newKeyId = () => `key_${randomBase62(20)}`;

export const WEBHOOK_ENDPOINT_ID = /^whe_[A-Za-z0-9]{20,40}$/;
/** Written by gateway.enqueue_webhooks (sql/000009.sql): `msg_` and 32 hex digits. */
export const WEBHOOK_MESSAGE_ID = /^msg_[A-Za-z0-9]{20,40}$/;

export const newWebhookEndpointId = () => `whe_${randomBase62(24)}`;
