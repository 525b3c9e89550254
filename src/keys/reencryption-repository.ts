// SQL of `gateway keys reencrypt`: the encrypted secrets read in batches along their primary
// key, and written back only where they are still what was read (a compare-and-set), so that
// the command can run beside the gateway, and twice, and never overwrite a newer secret.
import { sql, type Selectable } from 'kysely';
import type { Database } from '../db/database.ts';
import type { Db } from '../db/pool.ts';

export type SealedSigningSecret = Pick<Selectable<Database['api_keys']>, 'id' | 'signing_secret_ciphertext'>;

export type SealedWebhookSecrets = Pick<Selectable<Database['webhook_endpoints']>, 'id' | 'secret_ciphertext' | 'previous_secret_ciphertext'>;

/** A signing secret to write: the ciphertext read, and the one to put in its place. */
export interface SigningSecretChange {
  id: string;
  read: Buffer;
  sealed: Buffer;
}

/** An endpoint's secrets to write (the current and the previous one): as read, and what to put in their place. */
export interface WebhookSecretsChange {
  id: string;
  read: [Buffer, Buffer | null];
  sealed: [Buffer, Buffer | null];
}

/** Which rows a read takes: up to `limit` of them, by id, after `afterId`; or those ids. */
export type ReadFrom = { afterId: string; limit: number } | { ids: string[] };

/** Keys' encrypted signing secrets, by id. */
export async function readSigningSecrets(
  db: Db,
  from: ReadFrom,
): Promise<SealedSigningSecret[]> {
  let query = db.selectFrom('api_keys').select(['id', 'signing_secret_ciphertext']).orderBy('id');
  query = 'ids' in from ? query.where('id', 'in', from.ids) : query.where('id', '>', from.afterId).limit(from.limit);
  return query.execute();
}

/** Writes each new ciphertext where the row still has the one read; returns the ids written. */
export async function replaceSigningSecrets(
  db: Db,
  changes: SigningSecretChange[],
): Promise<Set<string>> {
  const { rows } = await sql<Pick<SealedSigningSecret, 'id'>>`
    update gateway.api_keys as keys
    set signing_secret_ciphertext = changes.sealed
    from unnest(
      ${changes.map((change) => change.id)}::text[],
      ${changes.map((change) => change.read)}::bytea[],
      ${changes.map((change) => change.sealed)}::bytea[]
    ) as changes (id, read, sealed)
    where keys.id = changes.id and keys.signing_secret_ciphertext = changes.read
    returning keys.id
  `.execute(db);
  return new Set(rows.map((row) => row.id));
}

/** Webhook endpoints' encrypted secrets, by id. */
export async function readWebhookSecrets(
  db: Db,
  from: ReadFrom,
): Promise<SealedWebhookSecrets[]> {
  let query = db
    .selectFrom('webhook_endpoints')
    .select(['id', 'secret_ciphertext', 'previous_secret_ciphertext'])
    .orderBy('id');
  query = 'ids' in from ? query.where('id', 'in', from.ids) : query.where('id', '>', from.afterId).limit(from.limit);
  return query.execute();
}

/**
 * Writes each endpoint's new ciphertexts where it still has both that were read (a rotation
 * meanwhile replaces them); returns the ids written.
 */
export async function replaceWebhookSecrets(
  db: Db,
  changes: WebhookSecretsChange[],
): Promise<Set<string>> {
  const { rows } = await sql<Pick<SealedWebhookSecrets, 'id'>>`
    update gateway.webhook_endpoints as endpoints
    set secret_ciphertext = changes.sealed, previous_secret_ciphertext = changes.sealed_previous
    from unnest(
      ${changes.map((change) => change.id)}::text[],
      ${changes.map((change) => change.read[0])}::bytea[],
      ${changes.map((change) => change.read[1])}::bytea[],
      ${changes.map((change) => change.sealed[0])}::bytea[],
      ${changes.map((change) => change.sealed[1])}::bytea[]
    ) as changes (id, read, read_previous, sealed, sealed_previous)
    where endpoints.id = changes.id
      and endpoints.secret_ciphertext = changes.read
      and endpoints.previous_secret_ciphertext is not distinct from changes.read_previous
    returning endpoints.id
  `.execute(db);
  return new Set(rows.map((row) => row.id));
}
