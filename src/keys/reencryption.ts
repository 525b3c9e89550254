// Rotating the encryption key (SECRET_ENCRYPTION_KEYS=<new>,<old>): `gateway keys reencrypt`
// re-encrypts every stored secret (keys' signing secrets, webhook endpoints' secrets and their
// previous ones) with the first key, so that the old keys can then be dropped. Batch by batch,
// each its own short statement; a secret already under the first key is left alone, so it is
// safe to run twice, and a row changed meanwhile is read again, so it is safe beside a running
// gateway (whose processes decrypt with any of the keys).
import type { Db } from '../db/pool.ts';
import * as repository from './reencryption-repository.ts';
import { decryptWith, encryptSecret } from './secrets.ts';
import { MissingEncryptionKeyError } from './service.ts';

const BATCH = 500;

export interface Reencryption {
  /** Keys (endpoints) whose secrets were under another key, and are now under the first. */
  reencrypted: number;
  /** Keys (endpoints) whose secrets were under the first key already. */
  current: number;
}

export interface ReencryptionReport {
  signingSecrets: Reencryption;
  webhookEndpoints: Reencryption;
  /** Ids (keys, endpoints) whose secret none of the keys decrypts: left as they are. */
  undecryptable: string[];
}

type Resealed = { kind: 'current' } | { kind: 'undecryptable' } | { kind: 'resealed'; sealed: Buffer };

/** A secret under the first key: as it is when it is so already, else decrypted with another and encrypted again. */
function reseal(sealed: Buffer, ownerId: string, keys: readonly Buffer[]): Resealed {
  const [first, ...others] = keys;
  const tryKey = (key: Buffer) => {
    try {
      return decryptWith(sealed, ownerId, key);
    } catch {
      return undefined; // a format this code does not know: no key of ours made it
    }
  };
  if (tryKey(first!) !== undefined) return { kind: 'current' };
  for (const key of others) {
    const secret = tryKey(key);
    if (secret !== undefined) return { kind: 'resealed', sealed: encryptSecret(secret, ownerId, first!) };
  }
  return { kind: 'undecryptable' };
}

export async function reencryptSecrets(
  db: Db,
  keys: readonly Buffer[],
  options: { batchSize?: number } = {},
): Promise<ReencryptionReport> {
  if (keys.length === 0) throw new MissingEncryptionKeyError();
  const batchSize = options.batchSize ?? BATCH;
  const undecryptable: string[] = [];

  const signingSecrets = await reencryptTable<repository.SealedSigningSecret, repository.SigningSecretChange>({
    batchSize,
    undecryptable,
    read: (from) => repository.readSigningSecrets(db, from),
    replace: (changes) => repository.replaceSigningSecrets(db, changes),
    plan: (row) => {
      const resealed = reseal(row.signing_secret_ciphertext, row.id, keys);
      if (resealed.kind !== 'resealed') return resealed.kind;
      return { id: row.id, read: row.signing_secret_ciphertext, sealed: resealed.sealed };
    },
  });

  const webhookEndpoints = await reencryptTable<repository.SealedWebhookSecrets, repository.WebhookSecretsChange>({
    batchSize,
    undecryptable,
    read: (from) => repository.readWebhookSecrets(db, from),
    replace: (changes) => repository.replaceWebhookSecrets(db, changes),
    plan: (row) => {
      const secret = reseal(row.secret_ciphertext, row.id, keys);
      const previous: Resealed | undefined =
        row.previous_secret_ciphertext === null ? undefined : reseal(row.previous_secret_ciphertext, row.id, keys);
      if (secret.kind === 'undecryptable' || previous?.kind === 'undecryptable') return 'undecryptable';
      if (secret.kind === 'current' && (previous === undefined || previous.kind === 'current')) return 'current';
      return {
        id: row.id,
        read: [row.secret_ciphertext, row.previous_secret_ciphertext],
        sealed: [
          secret.kind === 'resealed' ? secret.sealed : row.secret_ciphertext,
          previous?.kind === 'resealed' ? previous.sealed : row.previous_secret_ciphertext,
        ],
      };
    },
  });

  return { signingSecrets, webhookEndpoints, undecryptable };
}

/**
 * One table's secrets, batch by batch along the primary key: each row planned (already under the
 * first key, undecryptable, or a change), the changes written where the row is still as read, and
 * the rows changed meanwhile (another run of this command, a rotation) read and planned again.
 */
async function reencryptTable<Row extends { id: string }, Change extends { id: string }>(table: {
  batchSize: number;
  undecryptable: string[];
  read: (from: repository.ReadFrom) => Promise<Row[]>;
  replace: (changes: Change[]) => Promise<Set<string>>;
  plan: (row: Row) => 'current' | 'undecryptable' | Change;
}): Promise<Reencryption> {
  const counts: Reencryption = { reencrypted: 0, current: 0 };
  for (let afterId = ''; ; ) {
    let rows = await table.read({ afterId, limit: table.batchSize });
    if (rows.length === 0) return counts;
    afterId = rows.at(-1)!.id;
    while (rows.length > 0) {
      const changes: Change[] = [];
      for (const row of rows) {
        const planned = table.plan(row);
        if (planned === 'current') counts.current++;
        else if (planned === 'undecryptable') table.undecryptable.push(row.id);
        else changes.push(planned);
      }
      const written = changes.length === 0 ? new Set<string>() : await table.replace(changes);
      counts.reencrypted += written.size;
      const changed = changes.filter((change) => !written.has(change.id)).map((change) => change.id);
      rows = changed.length === 0 ? [] : await table.read({ ids: changed });
    }
  }
}
