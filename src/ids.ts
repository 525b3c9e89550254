// Identifiers and secrets, all written in base62 ([0-9A-Za-z], in ASCII order so that
// fixed-width encodings sort like the numbers they encode).
import { randomFillSync } from 'node:crypto';
import { crc32 } from 'node:zlib';

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

/**
 * The smallest id of a request created at `ms`: every request created earlier sorts below it. A
 * time before 1970 (a retention of more years than have passed since) has the floor of 1970,
 * below every id: base62Fixed takes no negative number.
 */
export function requestIdFloor(ms: number): string {
  return `req_${base62Fixed(Math.max(0, ms), 8)}`;
}

export type KeyMode = 'live' | 'test';

/**
 * A well-formed key (docs/api.md, "Authentication and keys"): whether the gateway could have
 * issued it is mayBeIssuedApiKey's question.
 */
export const API_KEY = /^svc_(live|test)_[A-Za-z0-9]{32,}$/;

// A key ends with a checksum, as GitHub's tokens do: `svc_live_` or `svc_test_`, 40 random
// characters, then 6 characters of base62 CRC32 of all that comes before them (the prefix too, so
// a key whose mode was changed fails it). A key made up, mistyped or cut short is then refused
// from its text alone, without a database read. Keys made before checksums have 40 characters
// after the prefix, none of them a checksum, and keep working: an API process knows which of
// them are active, and refuses any other key of that form without a read (keys/unchecksummed.ts).
// A key of any other length was never issued.
const KEY_PREFIX_LENGTH = 'svc_live_'.length;
const KEY_RANDOM_LENGTH = 40;
/** 62^6 > 2^32: six characters hold any CRC32. */
const KEY_CHECKSUM_LENGTH = 6;
const UNCHECKSUMMED_KEY_LENGTH = KEY_PREFIX_LENGTH + 40;
const CHECKSUMMED_KEY_LENGTH = KEY_PREFIX_LENGTH + KEY_RANDOM_LENGTH + KEY_CHECKSUM_LENGTH;

const apiKeyChecksum = (unchecked: string) => base62Fixed(crc32(unchecked), KEY_CHECKSUM_LENGTH);

export function newApiKey(mode: KeyMode): string {
  const unchecked = `svc_${mode}_${randomBase62(KEY_RANDOM_LENGTH)}`;
  return unchecked + apiKeyChecksum(unchecked);
}

/** Whether a well-formed key (API_KEY) is of the form keys had before checksums: 40 characters after the prefix. */
export const hasNoChecksum = (key: string): boolean => key.length === UNCHECKSUMMED_KEY_LENGTH;

/**
 * Whether a well-formed key (API_KEY) may be one the gateway issued, judged from its text: one
 * of today's length whose checksum matches, or one of the length keys had before checksums
 * (which of those are active is keys/unchecksummed.ts's question).
 */
export function mayBeIssuedApiKey(key: string): boolean {
  if (hasNoChecksum(key)) return true;
  if (key.length !== CHECKSUMMED_KEY_LENGTH) return false;
  const end = key.length - KEY_CHECKSUM_LENGTH;
  return apiKeyChecksum(key.slice(0, end)) === key.slice(end);
}
export const newSigningSecret = () => `svc_sig_${randomBase62(40)}`;
export const newKeyId = () => `key_${randomBase62(20)}`;

export const WEBHOOK_ENDPOINT_ID = /^whe_[A-Za-z0-9]{20,40}$/;
/** Written by gateway.enqueue_webhooks (sql/000009.sql): `msg_` and 32 hex digits. */
export const WEBHOOK_MESSAGE_ID = /^msg_[A-Za-z0-9]{20,40}$/;

export const newWebhookEndpointId = () => `whe_${randomBase62(24)}`;
