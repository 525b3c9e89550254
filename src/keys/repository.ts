// SQL for projects and API keys.
import { sql } from 'kysely';
import type { Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';
import { SIGNATURE_WINDOW_SECONDS } from './signatures.ts';

/** A signed POST's nonce, recorded (with the request it carried) so that it is accepted once. */
export interface Nonce {
  api_key_id: string;
  nonce: string;
}

/**
 * How much the clocks of the API processes may disagree with each other for a nonce to be kept
 * long enough (docs/operations.md): a process whose clock is behind the one that recorded a
 * nonce accepts its signature that much longer.
 */
export const API_CLOCKS_AGREE_SECONDS = SIGNATURE_WINDOW_SECONDS;

/**
 * How long a nonce is kept after it was recorded, by the database's clock: twice the signature
 * window, and API_CLOCKS_AGREE_SECONDS. The process that recorded it accepted the signature at
 * most one window before its timestamp, by its own clock; any process accepts it at most one
 * window after, by its own, which is at most API_CLOCKS_AGREE_SECONDS behind. Whatever the
 * database's clock says, the nonce outlives every moment a process would still accept the
 * signature; once deleted, it can no longer be replayed in time.
 */
export const NONCE_KEPT_SECONDS = 2 * SIGNATURE_WINDOW_SECONDS + API_CLOCKS_AGREE_SECONDS + 1;

export interface KeyRecord {
  id: string;
  project_id: string;
  mode: KeyMode;
  signing_secret_ciphertext: Buffer;
  revoked_at: Date | null;
  /** The key's request deadline, in milliseconds; null: REQUEST_DEADLINE. */
  request_deadline_ms: number | null;
}

export interface KeyListing {
  id: string;
  project: string;
  mode: KeyMode;
  key_hint: string;
  created_at: Date;
  revoked_at: Date | null;
  request_deadline_ms: number | null;
  /** false: made before keys recorded it, and may have no checksum. */
  checksummed: boolean;
}

/** The key's request_deadline in milliseconds (null when it has none). */
const deadlineMs = (column: string) => sql<number | null>`(extract(epoch from ${sql.ref(column)}) * 1000)::float8`;

/** The project's id, creating the project if it does not exist yet. */
export async function ensureProject(db: Db, name: string): Promise<string> {
  const row = await db
    .insertInto('projects')
    .values({ name })
    .onConflict((conflict) => conflict.column('name').doUpdateSet((eb) => ({ name: eb.ref('excluded.name') })))
    .returning('id')
    .executeTakeFirstOrThrow();
  return row.id;
}

export async function insertApiKey(
  db: Db,
  key: {
    id: string;
    project_id: string;
    mode: KeyMode;
    key_sha256: Buffer;
    key_hint: string;
    signing_secret_ciphertext: Buffer;
    /** Whether the key ends with a checksum (every key createKey makes does). */
    checksummed: boolean;
    /** undefined: the key has no deadline of its own (REQUEST_DEADLINE). */
    request_deadline_ms?: number | undefined;
  },
): Promise<void> {
  const { request_deadline_ms: deadline, ...columns } = key;
  await db
    .insertInto('api_keys')
    .values({ ...columns, request_deadline: deadline === undefined ? null : `${deadline} milliseconds` })
    .execute();
}

/**
 * The hashes of the active keys that may lack a checksum (made before
 * gateway.api_keys.checksummed was), `limit` + 1 at most: more than `limit` says there are more.
 */
export async function unchecksummedKeyHashes(db: Db, limit: number): Promise<Buffer[]> {
  const rows = await db
    .selectFrom('api_keys')
    .select('key_sha256')
    .where('checksummed', '=', false)
    .where('revoked_at', 'is', null)
    .limit(limit + 1)
    .execute();
  return rows.map((row) => row.key_sha256);
}

/**
 * The keys with these hashes, in their order (undefined for a hash no key has), in one statement:
 * a group of reads (keys/reads.ts) costs one round trip.
 */
export async function findKeysByHash(db: Db, hashes: readonly Buffer[]): Promise<(KeyRecord | undefined)[]> {
  const rows = await db
    .selectFrom('api_keys')
    .select(['key_sha256', 'id', 'project_id', 'mode', 'signing_secret_ciphertext', 'revoked_at', deadlineMs('request_deadline').as('request_deadline_ms')])
    .where(sql<boolean>`key_sha256 = any(${hashes}::bytea[])`)
    .execute();
  const byHash = new Map(rows.map(({ key_sha256: hash, ...key }) => [hash.toString('hex'), key]));
  return hashes.map((hash) => byHash.get(hash.toString('hex')));
}

/** The newest active key's id and encrypted signing secret (a sample of how secrets are stored). */
export async function findNewestSigningSecret(db: Db): Promise<{ id: string; signing_secret_ciphertext: Buffer } | undefined> {
  return db
    .selectFrom('api_keys')
    .select(['id', 'signing_secret_ciphertext'])
    .where('revoked_at', 'is', null)
    .orderBy('created_at', 'desc')
    .limit(1)
    .executeTakeFirst();
}

export async function listKeys(db: Db, projectName?: string): Promise<KeyListing[]> {
  let query = db
    .selectFrom('api_keys')
    .innerJoin('projects', 'projects.id', 'api_keys.project_id')
    .select([
      'api_keys.id',
      'projects.name as project',
      'api_keys.mode',
      'api_keys.key_hint',
      'api_keys.created_at',
      'api_keys.revoked_at',
      deadlineMs('api_keys.request_deadline').as('request_deadline_ms'),
      'api_keys.checksummed',
    ])
    .orderBy('projects.name')
    .orderBy('api_keys.created_at');
  if (projectName !== undefined) query = query.where('projects.name', '=', projectName);
  return query.execute();
}

/** Revokes the key; returns it, or undefined when there is no key with that id. */
export async function revokeKey(db: Db, id: string): Promise<KeyListing | undefined> {
  return db
    .with('revoked', (qb) =>
      qb
        .updateTable('api_keys')
        .set({ revoked_at: sql<Date>`coalesce(revoked_at, now())` })
        .where('id', '=', id)
        .returning([
          'id',
          'project_id',
          'mode',
          'key_hint',
          'created_at',
          'revoked_at',
          deadlineMs('request_deadline').as('request_deadline_ms'),
          'checksummed',
        ]),
    )
    .selectFrom('revoked')
    .innerJoin('projects', 'projects.id', 'revoked.project_id')
    .select([
      'revoked.id',
      'projects.name as project',
      'revoked.mode',
      'revoked.key_hint',
      'revoked.created_at',
      'revoked.revoked_at',
      'revoked.request_deadline_ms',
      'revoked.checksummed',
    ])
    .executeTakeFirst();
}

/** Records a nonce on its own (a signed POST that stores no request); false if it was already used. */
export async function insertNonce(db: Db, nonce: Nonce): Promise<boolean> {
  const { rows } = await sql<{ inserted: boolean }>`
    insert into gateway.signature_nonces (api_key_id, nonce, expires_at)
    values (${nonce.api_key_id}, ${nonce.nonce}, now() + ${NONCE_KEPT_SECONDS} * interval '1 second')
    on conflict do nothing
    returning true as inserted
  `.execute(db);
  return rows.length > 0;
}

/** Gives a nonce back, for a request that was refused after all. */
export async function deleteNonce(db: Db, nonce: Nonce): Promise<void> {
  await db
    .deleteFrom('signature_nonces')
    .where('api_key_id', '=', nonce.api_key_id)
    .where('nonce', '=', nonce.nonce)
    .execute();
}

/** Deletes up to `limit` expired nonces; returns how many. */
export async function deleteExpiredNonces(db: Db, limit: number): Promise<number> {
  const { rows } = await sql<{ deleted: string }>`
    with expired as (
      delete from gateway.signature_nonces
      where ctid = any (array(select ctid from gateway.signature_nonces where expires_at < now() limit ${limit}))
      returning 1
    )
    select count(*) as deleted from expired
  `.execute(db);
  return Number(rows[0]?.deleted ?? 0);
}
