// SQL of the worker's side of webhooks: claiming a message for a try, recording how the try
// ended, and handing back the tries of workers that died. Each function is one statement, so
// one round trip and its own transaction; every retry's deliver_webhook job is added in the
// statement that schedules it.
import { sql, type Selectable } from 'kysely';
import type { WebhookEndpointsTable, WebhookEvent, WebhookMessagesTable, WebhookMessageStatus } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import type { RecordRow } from '../requests/record.ts';
import { DELIVER_WEBHOOK } from './jobs.ts';

/** A message claimed for a try: what the try sends, and where. */
export interface ClaimedMessage {
  id: string;
  endpoint_id: string;
  event_type: WebhookEvent;
  /** When the request ended: the body's timestamp. */
  created_at: Date;
  /** The number of this try (webhook_deliveries.try_number). */
  tries: number;
  url: string;
  secret_ciphertext: Buffer;
  /** The secret before the last rotation, while it still signs; null otherwise. */
  previous_secret_ciphertext: Buffer | null;
  /** The request, as a lookup answers it. */
  request: RecordRow;
}

export type Claim =
  | { kind: 'claimed'; message: ClaimedMessage }
  /** Its endpoint was disabled (410): nothing is sent. */
  | { kind: 'abandoned' }
  /** Not pending or not due: delivered, given up, under way elsewhere, or removed with its endpoint. */
  | { kind: 'nothing' };

/**
 * Claims the message for a try by `workerId`, if it is pending and due: delivering, tries + 1,
 * and a running row in webhook_deliveries for the try. A message whose endpoint is disabled is
 * abandoned instead.
 */
export async function claimMessage(db: Db, messageId: string, workerId: string): Promise<Claim> {
  const { rows } = await sql<
    Pick<Selectable<WebhookMessagesTable>, 'id' | 'status' | 'endpoint_id' | 'event_type' | 'created_at' | 'tries'> &
      Pick<Selectable<WebhookEndpointsTable>, 'url' | 'secret_ciphertext' | 'previous_secret_ciphertext'> & {
        [Column in keyof RecordRow as `request_${Column}`]: RecordRow[Column];
      }
  >`
    with claimed as (
      update gateway.webhook_messages as messages
      set status = case when endpoints.disabled_at is null then 'delivering' else 'abandoned' end,
          tries = messages.tries + case when endpoints.disabled_at is null then 1 else 0 end,
          worker_id = case when endpoints.disabled_at is null then ${workerId} end,
          next_try_at = null,
          finished_at = case when endpoints.disabled_at is null then null else now() end
      from gateway.webhook_endpoints as endpoints
      where messages.id = ${messageId} and endpoints.id = messages.endpoint_id
        and messages.status = 'pending' and messages.next_try_at <= now()
      returning messages.id, messages.status, messages.endpoint_id, messages.request_id, messages.event_type,
                messages.created_at, messages.tries, endpoints.url, endpoints.secret_ciphertext,
                case when endpoints.previous_secret_expires_at > now() then endpoints.previous_secret_ciphertext end
                  as previous_secret_ciphertext
    ), tried as (
      insert into gateway.webhook_deliveries (message_id, try_number)
      select id, tries from claimed where status = 'delivering'
    )
    select claimed.*, requests.status as request_status, requests.attempts as request_attempts,
           requests.created_at as request_created_at, requests.updated_at as request_updated_at,
           requests.last_error_code as request_last_error_code, requests.result::text as request_result
    from claimed
    join gateway.requests on requests.id = claimed.request_id
  `.execute(db);
  const row = rows[0];
  if (!row) return { kind: 'nothing' };
  if (row.status !== 'delivering') return { kind: 'abandoned' };
  return {
    kind: 'claimed',
    message: {
      id: row.id,
      endpoint_id: row.endpoint_id,
      event_type: row.event_type,
      created_at: row.created_at,
      tries: row.tries,
      url: row.url,
      secret_ciphertext: row.secret_ciphertext,
      previous_secret_ciphertext: row.previous_secret_ciphertext,
      request: {
        id: row.request_id,
        status: row.request_status,
        attempts: row.request_attempts,
        created_at: row.request_created_at,
        updated_at: row.request_updated_at,
        last_error_code: row.request_last_error_code,
        result: row.request_result,
      },
    },
  };
}

/** How a try ended, and so what becomes of its message. */
export interface TryEnd {
  messageId: string;
  endpointId: string;
  tryNumber: number;
  /**
   * delivered: a 2xx. gone: a 410, which disables the endpoint. failed: anything else, retried
   * after retryInMs, or given up for good when retryInMs is undefined (the schedule is spent).
   */
  kind: 'delivered' | 'gone' | 'failed';
  retryInMs?: number | undefined;
  httpStatus: number | null;
  /** Why it failed, in our words; null when delivered. */
  error: string | null;
  durationMs: number;
}

/**
 * Records how a try ended, in one statement: its row in webhook_deliveries, and its message:
 * delivered; pending again with a deliver_webhook job due at its next try; failed, the schedule
 * spent; or abandoned, its endpoint disabled (by this 410, or meanwhile by another's: then only
 * a 2xx still counts). A 410 also disables the endpoint and abandons its pending messages.
 * Guarded by the message still being delivering this very try: a try that the sweep handed back
 * (its worker presumed dead) changes nothing. Returns the message's new status, or undefined
 * when the try was no longer its own.
 */
export async function finishTry(db: Db, end: TryEnd): Promise<WebhookMessageStatus | undefined> {
  const retrying = end.kind === 'failed' && end.retryInMs !== undefined;
  const { rows } = await sql<{ status: WebhookMessageStatus | null }>`
    with try_row as (
      update gateway.webhook_deliveries
      set outcome = ${end.kind === 'delivered' ? 'succeeded' : 'failed'}, finished_at = now(),
          http_status = ${end.httpStatus}, error = ${end.error}, duration_ms = ${end.durationMs}
      where message_id = ${end.messageId} and try_number = ${end.tryNumber} and outcome = 'running'
    ), disabled as (
      update gateway.webhook_endpoints
      set disabled_at = coalesce(disabled_at, now()),
          disabled_reason = coalesce(disabled_reason, 'it answered 410 Gone')
      where id = ${end.endpointId} and ${end.kind === 'gone'}::boolean
      returning id
    ), message as (
      update gateway.webhook_messages as messages
      set status = next.status,
          next_try_at = case when next.status = 'pending'
                             then now() + ${end.retryInMs ?? 0}::float8 * interval '1 millisecond' end,
          finished_at = case when next.status = 'pending' then null else now() end,
          worker_id = null
      from (
        select case
                 when ${end.kind}::text = 'delivered' then 'delivered'
                 when ${end.kind}::text = 'gone' or endpoints.disabled_at is not null then 'abandoned'
                 when ${retrying}::boolean then 'pending'
                 else 'failed'
               end as status
        from gateway.webhook_endpoints as endpoints
        where endpoints.id = ${end.endpointId}
      ) as next
      where messages.id = ${end.messageId} and messages.tries = ${end.tryNumber} and messages.status = 'delivering'
      returning messages.id, messages.status, messages.next_try_at
    ), abandoned as (
      update gateway.webhook_messages as messages
      set status = 'abandoned', next_try_at = null, finished_at = now()
      from disabled
      where messages.endpoint_id = disabled.id and messages.status = 'pending'
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${DELIVER_WEBHOOK}, json_build_object('message_id', message.id), null, message.next_try_at,
                   null, null, null, null)::graphile_worker.job_spec
        from message where message.status = 'pending'
      ))
      where exists (select from message where message.status = 'pending')
    )
    select message.status from (select 1) as one
    cross join queued
    left join message on true
  `.execute(db);
  return rows[0]?.status ?? undefined;
}

/** Adds a deliver_webhook job for the message, due in `delayMs`: a try this worker cannot make now. */
export async function addDeliveryJob(db: Db, messageId: string, delayMs: number): Promise<void> {
  await sql`
    select graphile_worker.add_job(${DELIVER_WEBHOOK}, json_build_object('message_id', ${messageId}::text),
                                   run_at => now() + ${delayMs}::float8 * interval '1 millisecond')
  `.execute(db);
}

/**
 * Hands back the tries of workers that died: messages delivering whose worker has no row in
 * gateway.worker_pools (deleted as dead, or never written), whose try started more than
 * `deadAfterMs` ago (so a worker starting up is not taken for a dead one), never those of the
 * workers in `live`. Each try is recorded as failed, and its message is pending again, due now,
 * with a deliver_webhook job (abandoned if its endpoint was disabled meanwhile). Returns how many.
 */
export async function recoverLostDeliveries(db: Db, deadAfterMs: number, live: readonly string[], limit: number): Promise<number> {
  const { rows } = await sql<{ recovered: string }>`
    with lost as (
      select messages.id, messages.tries
      from gateway.webhook_messages as messages
      where messages.status = 'delivering'
        and not exists (select from gateway.worker_pools where worker_pools.id = messages.worker_id)
        and coalesce(messages.worker_id, '') <> all(${live}::text[])
        and exists (
          select from gateway.webhook_deliveries as deliveries
          where deliveries.message_id = messages.id and deliveries.try_number = messages.tries
            and deliveries.started_at < now() - ${deadAfterMs}::float8 * interval '1 millisecond'
        )
      limit ${limit}
      for update of messages skip locked
    ), tries as (
      update gateway.webhook_deliveries as deliveries
      set outcome = 'failed', finished_at = now(), error = 'the worker stopped during the try'
      from lost
      where deliveries.message_id = lost.id and deliveries.try_number = lost.tries and deliveries.outcome = 'running'
    ), recovered as (
      update gateway.webhook_messages as messages
      set status = case when endpoints.disabled_at is null then 'pending' else 'abandoned' end,
          next_try_at = case when endpoints.disabled_at is null then now() end,
          finished_at = case when endpoints.disabled_at is null then null else now() end,
          worker_id = null
      from lost, gateway.webhook_endpoints as endpoints
      where messages.id = lost.id and endpoints.id = messages.endpoint_id
      returning messages.id, messages.status
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${DELIVER_WEBHOOK}, json_build_object('message_id', recovered.id), null, null,
                   null, null, null, null)::graphile_worker.job_spec
        from recovered where recovered.status = 'pending'
      ))
      where exists (select from recovered where recovered.status = 'pending')
    )
    select count(*) as recovered from recovered cross join queued
  `.execute(db);
  return Number(rows[0]?.recovered ?? 0);
}
