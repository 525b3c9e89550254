// API keys: creation (the key and its signing secret are shown once, then only kept hashed
// and encrypted), listing, revocation, and authenticating a request's bearer key.
import * as v from 'valibot';
import type { Db } from '../db/pool.ts';
import { authenticationError } from '../errors.ts';
import { API_KEY, hasNoChecksum, type KeyMode, mayBeIssuedApiKey, newApiKey, newKeyId, newSigningSecret } from '../ids.ts';
import type { Auth } from './auth.ts';
import type { KeyCache } from './cache.ts';
import type { KeyReads } from './reads.ts';
import type { UnchecksummedKeys } from './unchecksummed.ts';
import * as repository from './repository.ts';
import { decryptSecret, encryptSecret, hashApiKey } from './secrets.ts';

export type { KeyListing } from './repository.ts';

export interface CreatedKey {
  id: string;
  project: string;
  mode: KeyMode;
  api_key: string;
  signing_secret: string;
}

export const ProjectName = v.pipe(
  v.string(),
  v.regex(
    /^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$/,
    'A project name is 1 to 100 letters, digits, dots, dashes or underscores, starting with a letter or digit.',
  ),
);

export class MissingEncryptionKeyError extends Error {
  override name = 'MissingEncryptionKeyError';
  constructor() {
    super(
      'SECRET_ENCRYPTION_KEY is not set: signing secrets cannot be stored or verified without it ' +
        '(generate one with `openssl rand -base64 32`).',
    );
  }
}

export async function createKey(
  db: Db,
  encryptionKey: Buffer | undefined,
  input: { project: string; mode: KeyMode; deadlineMs?: number | undefined },
): Promise<CreatedKey> {
  if (!encryptionKey) throw new MissingEncryptionKeyError();
  const project = v.parse(ProjectName, input.project);
  const id = newKeyId();
  const apiKey = newApiKey(input.mode);
  const signingSecret = newSigningSecret();
  await db.transaction().execute(async (tx) => {
    const projectId = await repository.ensureProject(tx, project);
    await repository.insertApiKey(tx, {
      id,
      project_id: projectId,
      mode: input.mode,
      key_sha256: hashApiKey(apiKey),
      key_hint: apiKey.slice(-4),
      signing_secret_ciphertext: encryptSecret(signingSecret, id, encryptionKey),
      checksummed: true,
      request_deadline_ms: input.deadlineMs,
    });
  });
  return { id, project, mode: input.mode, api_key: apiKey, signing_secret: signingSecret };
}

export const listKeys = (db: Db, project?: string) => repository.listKeys(db, project);

export const revokeKey = (db: Db, id: string) => repository.revokeKey(db, id);

const BEARER = /^Bearer +(\S+) *$/i;

/** What authenticate works with besides the database: each optional. */
export interface KeyChecks {
  /** Keys (and misses) held in memory: a key it holds costs no read, nor waits for one. */
  cache?: KeyCache | undefined;
  /** Reads of keys the cache does not hold, grouped and bounded (beyond the bound: a 503). */
  reads?: KeyReads | undefined;
  /** Hears of each well-formed key that is not there (never issued, unknown or revoked). */
  onUnknown?: (() => void) | undefined;
  /** Which keys without a checksum may be active (unchecksummed.ts); without it, any may. */
  unchecksummed?: Pick<UnchecksummedKeys, 'mayBeActive'> | undefined;
}

/**
 * The caller behind an Authorization header, or a 401 ApiError. A key the gateway cannot have
 * issued (its checksum does not match: ids.ts), or one without a checksum that is none of the
 * active keys of that form, is refused without a read.
 */
export async function authenticate(
  db: Db,
  authorization: string | undefined,
  { cache, reads, onUnknown, unchecksummed }: KeyChecks = {},
): Promise<Auth> {
  if (authorization === undefined || authorization.trim() === '') {
    throw authenticationError(
      'missing_api_key',
      'No API key was sent. Send it in the Authorization header: "Authorization: Bearer <API key>".',
    );
  }
  const token = BEARER.exec(authorization)?.[1];
  if (token === undefined || !API_KEY.test(token)) throw invalidApiKey();
  const keySha256 = mayBeIssuedApiKey(token) ? hashApiKey(token) : undefined;
  if (keySha256 === undefined || (hasNoChecksum(token) && unchecksummed?.mayBeActive(keySha256) === false)) {
    onUnknown?.();
    throw invalidApiKey();
  }
  const cached = cache?.get(keySha256);
  if (cached) return cached;
  const read = () => readKey(db, keySha256, reads);
  const auth = await (cache ? cache.read(keySha256, read) : read());
  if (auth === undefined) {
    onUnknown?.();
    throw invalidApiKey();
  }
  return auth;
}

/**
 * The id of a key whose signing secret none of these encryption keys decrypts, or undefined
 * when they do. One secret is tried, the newest active key's: an API process started with the
 * wrong keys would answer every signed request with a 500, so it checks before it starts.
 */
export async function signingSecretNotDecrypted(db: Db, encryptionKeys: readonly Buffer[]): Promise<string | undefined> {
  const newest = await repository.findNewestSigningSecret(db);
  if (newest === undefined) return undefined;
  try {
    decryptSecret(newest.signing_secret_ciphertext, newest.id, encryptionKeys);
    return undefined;
  } catch {
    return newest.id;
  }
}

/** The key with that hash, unless there is none or it is revoked: read with others through `reads` when given. */
async function readKey(db: Db, keySha256: Buffer, reads: KeyReads | undefined): Promise<Auth | undefined> {
  const key = reads ? await reads.read(keySha256) : (await repository.findKeysByHash(db, [keySha256]))[0];
  if (key === undefined || key.revoked_at !== null) return undefined;
  return {
    keyId: key.id,
    projectId: key.project_id,
    mode: key.mode,
    signingSecretCiphertext: key.signing_secret_ciphertext,
    requestDeadlineMs: key.request_deadline_ms ?? undefined,
  };
}

const invalidApiKey = () => authenticationError('invalid_api_key', 'The API key is not valid.');
