// SQL for webhook endpoints, as `gateway webhooks` manages them, and the age of the oldest
// message still to deliver, as the metrics show it (metrics.ts). (The worker's statements,
// which deliver the messages, are in delivery-repository.ts.)
import { sql } from 'kysely';
import type { WebhookEvent } from '../db/database.ts';
import type { Db } from '../db/pool.ts';

/** An endpoint as it is listed: never its secrets. */
export interface EndpointListing {
  id: string;
  project: string;
  url: string;
  events: WebhookEvent[];
  created_at: Date;
  /** While the secret of before the last rotation still signs beside the current one. */
  previous_secret_expires_at: Date | null;
  disabled_at: Date | null;
  disabled_reason: string | null;
}

export async function insertEndpoint(
  db: Db,
  endpoint: { id: string; project_id: string; url: string; events: WebhookEvent[]; secret_ciphertext: Buffer },
): Promise<void> {
  await db.insertInto('webhook_endpoints').values(endpoint).execute();
}

const listings = (db: Db) =>
  db
    .selectFrom('webhook_endpoints')
    .innerJoin('projects', 'projects.id', 'webhook_endpoints.project_id')
    .select([
      'webhook_endpoints.id',
      'projects.name as project',
      'webhook_endpoints.url',
      'webhook_endpoints.events',
      'webhook_endpoints.created_at',
      sql<Date | null>`case when webhook_endpoints.previous_secret_expires_at > now()
                            then webhook_endpoints.previous_secret_expires_at end`.as('previous_secret_expires_at'),
      'webhook_endpoints.disabled_at',
      'webhook_endpoints.disabled_reason',
    ]);

export async function listEndpoints(db: Db, projectName?: string): Promise<EndpointListing[]> {
  let query = listings(db).orderBy('projects.name').orderBy('webhook_endpoints.created_at').orderBy('webhook_endpoints.id');
  if (projectName !== undefined) query = query.where('projects.name', '=', projectName);
  return query.execute();
}

async function findEndpoint(db: Db, id: string): Promise<EndpointListing | undefined> {
  return listings(db).where('webhook_endpoints.id', '=', id).executeTakeFirst();
}

/**
 * Deletes the endpoint, and with it (on delete cascade) its messages and their tries, delivered
 * or not; returns what it was and how many messages were still to deliver.
 */
export async function deleteEndpoint(
  db: Db,
  id: string,
): Promise<(EndpointListing & { undelivered_messages: number }) | undefined> {
  return db.transaction().execute(async (tx) => {
    const endpoint = await findEndpoint(tx, id);
    if (!endpoint) return undefined;
    const { undelivered } = await tx
      .selectFrom('webhook_messages')
      .select(sql<string>`count(*)`.as('undelivered'))
      .where('endpoint_id', '=', id)
      .where('finished_at', 'is', null)
      .executeTakeFirstOrThrow();
    await tx.deleteFrom('webhook_endpoints').where('id', '=', id).execute();
    return { ...endpoint, undelivered_messages: Number(undelivered) };
  });
}

/**
 * Makes `secretCiphertext` the endpoint's secret; the one it replaces keeps signing until
 * `overlapMs` from now (a secret older than that, from an earlier rotation, is dropped). Returns
 * the endpoint, or undefined when there is none with that id.
 */
export async function rotateEndpointSecret(
  db: Db,
  id: string,
  secretCiphertext: Buffer,
  overlapMs: number,
): Promise<EndpointListing | undefined> {
  const rotated = await db
    .updateTable('webhook_endpoints')
    .set((eb) => ({
      previous_secret_ciphertext: eb.ref('secret_ciphertext'),
      previous_secret_expires_at: sql<Date>`now() + ${overlapMs}::float8 * interval '1 millisecond'`,
      secret_ciphertext: secretCiphertext,
    }))
    .where('id', '=', id)
    .returning('id')
    .executeTakeFirst();
  return rotated && findEndpoint(db, rotated.id);
}

/** How long ago (in seconds) the oldest message not delivered nor given up was created; 0 when there is none. */
export async function oldestUnfinishedMessageAge(db: Db): Promise<number> {
  // (the partial index webhook_messages_unfinished answers it at once)
  const { rows } = await sql<{ age: number | null }>`
    select extract(epoch from now() - min(created_at))::float8 as age
    from gateway.webhook_messages where finished_at is null
  `.execute(db);
  return rows[0]?.age ?? 0;
}
