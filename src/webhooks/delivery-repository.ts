// SQL of the worker's side of webhooks: claiming messages for tries (one by its job, or an
// endpoint's waiting ones by its wake job), scheduling an endpoint's wake, recording how a try
// ended (and what it says of its endpoint), and handing back the tries of workers that died and
// those that a live worker lost track of. Each function is one statement, so one round trip and
// its own transaction; every retry's deliver_webhook job is added in the statement that
// schedules it.
import { sql, type RawBuilder, type Selectable } from 'kysely';
import type { WebhookEndpointsTable, WebhookEvent, WebhookMessagesTable, WebhookMessageStatus } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import { statement } from '../db/statement.ts';
import type { RecordRow } from '../requests/record.ts';
import { DELIVER_WEBHOOK, WAKE_WEBHOOK_ENDPOINT, wakeJobKey } from './jobs.ts';

/** A message claimed for a try: what the try sends, and where. */
export interface ClaimedMessage {
  id: string;
  endpoint_id: string;
  event_type: WebhookEvent;
  /** When the request ended: the body's timestamp. */
  created_at: Date;
  /** The number of this try (webhook_deliveries.try_number). */
  tries: number;
  /** The tries before it that failed, each spending a wait of the retry schedule (not those their worker lost or could not sign). */
  failures: number;
  url: string;
  secret_ciphertext: Buffer;
  /** The secret before the last rotation, while it still signs; null otherwise. */
  previous_secret_ciphertext: Buffer | null;
  /** The request, as a lookup answers it. */
  request: RecordRow;
}

export type Claim =
  /** probe: the endpoint backs off, and this is its one try at a time. */
  | { kind: 'claimed'; message: ClaimedMessage; probe: boolean }
  /** Its endpoint was disabled (410): nothing is sent. */
  | { kind: 'abandoned' }
  /** Its endpoint backs off, or its retry-after holds it, and no try may start on it now: the message waits. */
  | { kind: 'paused' }
  /** Not pending or not due: delivered, given up, under way elsewhere, or removed with its endpoint. */
  | { kind: 'nothing' };

/** What a claim returns of each message, and of its request (the record of a lookup). */
type ClaimedRow = Pick<Selectable<WebhookMessagesTable>, 'id' | 'status' | 'endpoint_id' | 'event_type' | 'created_at' | 'tries' | 'failures'> &
  Pick<Selectable<WebhookEndpointsTable>, 'url' | 'secret_ciphertext' | 'previous_secret_ciphertext'> & {
    [Column in keyof RecordRow as `request_${Column}`]: RecordRow[Column];
  };

/**
 * The tail of a claim, after the CTEs `target` (the messages to claim: their id and endpoint_id,
 * locked), `endpoint` (their one endpoint's row as the claim read it, with `paused`: whether it
 * backs off or a retry-after holds it now) and `probe`: the messages become delivering, tries + 1,
 * with a running row in webhook_deliveries for the try (abandoned instead when the endpoint is
 * disabled), if the endpoint is disabled, is not paused, or this claim is its probe. The CTE
 * `claimed_rows` returns them with their requests.
 */
function claimTargets(workerId: RawBuilder<unknown>): RawBuilder<unknown> {
  return sql`
    claimed as (
      update gateway.webhook_messages as messages
      set status = case when endpoints.disabled_at is null then 'delivering' else 'abandoned' end,
          tries = messages.tries + case when endpoints.disabled_at is null then 1 else 0 end,
          worker_id = case when endpoints.disabled_at is null then ${workerId} end,
          next_try_at = null,
          finished_at = case when endpoints.disabled_at is null then null else now() end
      from target, endpoint, gateway.webhook_endpoints as endpoints
      where messages.id = target.id and endpoint.id = target.endpoint_id and endpoints.id = target.endpoint_id
        and (endpoint.disabled_at is not null or not endpoint.paused or exists (select from probe))
      returning messages.id, messages.status, messages.endpoint_id, messages.request_id, messages.event_type,
                messages.created_at, messages.tries, messages.failures, endpoints.url, endpoints.secret_ciphertext,
                case when endpoints.previous_secret_expires_at > now() then endpoints.previous_secret_ciphertext end
                  as previous_secret_ciphertext
    ), tried as (
      insert into gateway.webhook_deliveries (message_id, try_number)
      select id, tries from claimed where status = 'delivering'
    ), claimed_rows as (
      select claimed.*, requests.status as request_status, requests.attempts as request_attempts,
             requests.created_at as request_created_at, requests.updated_at as request_updated_at,
             requests.last_error_code as request_last_error_code, requests.result::text as request_result
      from claimed
      join gateway.requests on requests.id = claimed.request_id
    )`;
}

/**
 * The probe of an endpoint that backs off (a CTE, after `target` and `endpoint`): a try starts on
 * it only once its wait is over, one at a time. The probe pushes paused_until to `probeMs` from
 * now under the endpoint's row lock, so that a claim at the same moment finds it paused. `probe`
 * has a row when this claim is the probe.
 */
function probeEndpoint(probeMs: RawBuilder<unknown>): RawBuilder<unknown> {
  return sql`
    probe as (
      update gateway.webhook_endpoints as endpoints
      set paused_until = now() + ${probeMs}::float8 * interval '1 millisecond'
      from endpoint
      where endpoints.id = endpoint.id and endpoint.disabled_at is null and endpoint.backoff_ms is not null
        and endpoints.backoff_ms is not null and endpoints.paused_until <= now()
        and exists (select from target)
      returning endpoints.id
    )`;
}

/**
 * Whether a claim finds the endpoint (`endpoints`) paused: backing off (only its probe may start,
 * once its wait is over), or held by the retry-after of its 429 or 503 until paused_until.
 */
const endpointPaused = sql`(endpoints.backoff_ms is not null or coalesce(endpoints.paused_until > now(), false))`;

function claimedMessage(row: ClaimedRow): ClaimedMessage {
  return {
    id: row.id,
    endpoint_id: row.endpoint_id,
    event_type: row.event_type,
    created_at: row.created_at,
    tries: row.tries,
    failures: row.failures,
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
  };
}

const claimMessageStatement = statement(
  ['message_id', 'worker_id', 'probe_ms'] as const,
  (v) => sql<Partial<ClaimedRow> & { waiting: boolean; probe: boolean }>`
    with target as (
      select messages.id, messages.endpoint_id
      from gateway.webhook_messages as messages
      where messages.id = ${v.message_id} and messages.status = 'pending' and messages.next_try_at <= now()
      for update of messages skip locked
    ), endpoint as (
      select endpoints.id, endpoints.disabled_at, endpoints.backoff_ms, ${endpointPaused} as paused
      from gateway.webhook_endpoints as endpoints
      join target on target.endpoint_id = endpoints.id
    ), ${probeEndpoint(v.probe_ms)}, ${claimTargets(v.worker_id)}
    select claimed_rows.*, exists (select from target) as waiting, exists (select from probe) as probe
    from (select 1) as one
    left join claimed_rows on true
  `,
);

/**
 * Claims the message for a try by `workerId`, if it is pending and due: delivering, tries + 1,
 * and a running row in webhook_deliveries for the try. A message whose endpoint is disabled is
 * abandoned instead; one whose endpoint backs off stays as it is (paused), unless this try is the
 * endpoint's probe (`probeMs`: how long the probe keeps others off).
 */
export async function claimMessage(db: Db, messageId: string, workerId: string, probeMs: number): Promise<Claim> {
  const { rows } = await claimMessageStatement.execute(db, { message_id: messageId, worker_id: workerId, probe_ms: probeMs });
  const row = rows[0];
  if (!row?.id) return row?.waiting ? { kind: 'paused' } : { kind: 'nothing' };
  if (row.status !== 'delivering') return { kind: 'abandoned' };
  return { kind: 'claimed', message: claimedMessage(row as ClaimedRow), probe: row.probe };
}

/** What a claim of an endpoint's due messages did. */
export interface DueClaim {
  /** The messages claimed, oldest due first (abandoned ones, of a disabled endpoint, are not listed). */
  messages: { message: ClaimedMessage; probe: boolean }[];
  /** Messages abandoned (the endpoint is disabled). */
  abandoned: number;
  /**
   * The endpoint backs off, or its retry-after holds it, and some of its messages were due: the
   * claim took its probe, or none could start (the others wait for the probe's end, the backoff's,
   * or the retry-after's).
   */
  backingOff: boolean;
}

const claimDueStatement = statement(
  ['endpoint_id', 'worker_id', 'limit', 'probe_ms'] as const,
  (v) => sql<Partial<ClaimedRow> & { backing_off: boolean; probe: boolean }>`
    with endpoint as (
      select endpoints.id, endpoints.disabled_at, endpoints.backoff_ms, ${endpointPaused} as paused
      from gateway.webhook_endpoints as endpoints
      where endpoints.id = ${v.endpoint_id}
    ), target as (
      select messages.id, messages.endpoint_id
      from gateway.webhook_messages as messages
      where messages.endpoint_id = ${v.endpoint_id} and messages.status = 'pending' and messages.next_try_at <= now()
      order by messages.next_try_at, messages.id
      -- (paused: the one that may be its probe)
      limit (select case when not endpoint.paused or endpoint.disabled_at is not null then ${v.limit}::int else 1 end
             from endpoint)
      for update of messages skip locked
    ), ${probeEndpoint(v.probe_ms)}, ${claimTargets(v.worker_id)}
    select claimed_rows.*, exists (select from probe) as probe,
           exists (select from target)
             and exists (select from endpoint where endpoint.disabled_at is null and endpoint.paused) as backing_off
    from (select 1) as one
    left join claimed_rows on true
  `,
);

/**
 * Claims up to `limit` of the endpoint's due messages for tries by `workerId`, oldest due first,
 * as claimMessage claims one: while the endpoint backs off, only its probe, when the wait is over.
 * Messages locked by another claim at the same moment are passed over.
 */
export async function claimDue(db: Db, endpointId: string, workerId: string, limit: number, probeMs: number): Promise<DueClaim> {
  const { rows } = await claimDueStatement.execute(db, { endpoint_id: endpointId, worker_id: workerId, limit, probe_ms: probeMs });
  const claim: DueClaim = { messages: [], abandoned: 0, backingOff: rows[0]?.backing_off ?? false };
  for (const row of rows) {
    if (!row.id) continue;
    if (row.status === 'delivering') claim.messages.push({ message: claimedMessage(row as ClaimedRow), probe: row.probe });
    else claim.abandoned++;
  }
  return claim;
}

/**
 * Makes sure the endpoint's wake_webhook_endpoint job will run, if some of its messages wait
 * (pending and due; with `messageId`, if that one does): due in `delayMs`, and not before the
 * endpoint's backoff lets a try start. A job already waiting to run is left as it is, unless
 * it is due later than that and either `advance` or it has failed: a wake waiting out
 * graphile-worker's backoff (exp(attempts) seconds, hours after a few failures: a database that
 * refused statements for minutes leaves its jobs so) is replaced by one due when this one is.
 * (A job under way is not counted: it may have looked before this message began to wait.)
 * Returns whether messages wait.
 */
export async function scheduleWake(
  db: Db,
  wake: { endpointId: string; delayMs: number; deferrals: number; advance?: boolean; messageId?: string },
): Promise<boolean> {
  const key = wakeJobKey(wake.endpointId);
  const { rows } = await sql<{ waiting: boolean }>`
    with waiting as (
      select exists (
        select from gateway.webhook_messages as messages
        where messages.endpoint_id = ${wake.endpointId} and messages.status = 'pending' and messages.next_try_at <= now()
          ${wake.messageId === undefined ? sql`` : sql`and messages.id = ${wake.messageId}`}
      ) as waiting
    ), due as (
      select greatest(now() + ${wake.delayMs}::float8 * interval '1 millisecond', endpoints.paused_until) as run_at
      from gateway.webhook_endpoints as endpoints, waiting
      where endpoints.id = ${wake.endpointId} and endpoints.disabled_at is null and waiting.waiting
    ), scheduled as (
      select jobs.run_at, jobs.attempts
      from graphile_worker.jobs
      where jobs.key = ${key} and jobs.locked_at is null and jobs.attempts < jobs.max_attempts
    ), wake as (
      select due.run_at from due
      where not exists (select from scheduled)
         or exists (select from scheduled
                    where scheduled.run_at > due.run_at and (${wake.advance ?? false}::boolean or scheduled.attempts > 0))
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${WAKE_WEBHOOK_ENDPOINT}, json_build_object('endpoint_id', ${wake.endpointId}::text, 'deferrals', ${wake.deferrals}::int),
                   null, wake.run_at, null, ${key}, null, null)::graphile_worker.job_spec
        from wake
      ))
      where exists (select from wake)
    )
    select waiting.waiting from waiting cross join queued
  `.execute(db);
  return rows[0]?.waiting ?? false;
}

/** The endpoint of a message (for the jobs of schemas before sql/000014.sql, whose payload does not name it). */
export async function findMessageEndpoint(db: Db, messageId: string): Promise<string | undefined> {
  const row = await db.selectFrom('webhook_messages').select('endpoint_id').where('id', '=', messageId).executeTakeFirst();
  return row?.endpoint_id;
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
  /**
   * A failure that spends a wait of the retry schedule (webhook_messages.failures): not a try our
   * shutdown cut short, nor one we could not sign (the endpoint's secret is under a key we lack).
   */
  spendsRetry?: boolean;
  httpStatus: number | null;
  /** Why it failed, in our words; null when delivered. */
  error: string | null;
  durationMs: number;
  /**
   * What the try says of its endpoint: true, no answer within the timeout (it backs off); false,
   * it ended otherwise (its backoff ends); undefined, nothing (our shutdown cut it short, or our bug).
   */
  timedOut: boolean | undefined;
  /** The retry-after of a 429 or 503: no try starts on the endpoint, for any message, for this long. */
  pauseMs?: number | undefined;
}

/** The waits of an endpoint that backs off: the first, and the longest (each doubles the one before). */
export interface EndpointBackoff {
  minMs: number;
  maxMs: number;
}

/** An endpoint's next wait when a try times out: its wait doubled, from `backoff`'s least, up to its most. */
const nextBackoff = (v: Record<'backoff_min_ms' | 'backoff_max_ms', RawBuilder<unknown>>) =>
  sql`least(${v.backoff_max_ms}::int, coalesce(endpoints.backoff_ms * 2, ${v.backoff_min_ms}::int))`;

const finishTryStatement = statement(
  [
    'outcome', 'http_status', 'error', 'duration_ms', 'message_id', 'try_number', 'gone', 'timed_out', 'backoff_min_ms',
    'backoff_max_ms', 'endpoint_id', 'retry_in_ms', 'kind', 'retrying', 'spends_retry', 'pause_ms',
  ] as const,
  (v) => sql<{ status: WebhookMessageStatus | null }>`
    with try_row as (
      update gateway.webhook_deliveries
      set outcome = ${v.outcome}, finished_at = now(),
          http_status = ${v.http_status}, error = ${v.error}, duration_ms = ${v.duration_ms}
      where message_id = ${v.message_id} and try_number = ${v.try_number} and outcome = 'running'
      returning started_at
    ), endpoint as (
      update gateway.webhook_endpoints as endpoints
      set disabled_at = case when ${v.gone}::boolean then coalesce(endpoints.disabled_at, now()) else endpoints.disabled_at end,
          disabled_reason = case when ${v.gone}::boolean then coalesce(endpoints.disabled_reason, 'it answered 410 Gone')
                                 else endpoints.disabled_reason end,
          backoff_ms = case when ${v.timed_out}::boolean is null then endpoints.backoff_ms
                            when ${v.timed_out}::boolean then ${nextBackoff(v)} end,
          timed_out_at = case when ${v.timed_out}::boolean is null then endpoints.timed_out_at
                              when ${v.timed_out}::boolean then now() end,
          -- (a retry-after's pause, without backoff_ms, is never shortened: a time-out or another retry-after may lengthen it)
          paused_until = case when ${v.timed_out}::boolean is null then endpoints.paused_until
                              when ${v.timed_out}::boolean
                                then greatest(now() + ${nextBackoff(v)} * interval '1 millisecond',
                                              case when endpoints.backoff_ms is null then endpoints.paused_until end)
                              when ${v.pause_ms}::float8 is not null
                                then greatest(now() + ${v.pause_ms}::float8 * interval '1 millisecond',
                                              case when endpoints.backoff_ms is null then endpoints.paused_until end)
                              when endpoints.backoff_ms is null then endpoints.paused_until end
      where endpoints.id = ${v.endpoint_id}
        and (${v.gone}::boolean
             or (${v.timed_out}::boolean and (endpoints.timed_out_at is null
                                           or endpoints.timed_out_at < (select started_at from try_row)))
             or (not ${v.timed_out}::boolean and (endpoints.backoff_ms is not null or ${v.pause_ms}::float8 is not null)))
      returning endpoints.id
    ), disabled as (
      select endpoint.id from endpoint where ${v.gone}::boolean
    ), message as (
      update gateway.webhook_messages as messages
      set status = next.status,
          failures = messages.failures + case when ${v.spends_retry}::boolean then 1 else 0 end,
          next_try_at = case when next.status = 'pending'
                             then now() + ${v.retry_in_ms}::float8 * interval '1 millisecond' end,
          finished_at = case when next.status = 'pending' then null else now() end,
          worker_id = null
      from (
        select case
                 when ${v.kind}::text = 'delivered' then 'delivered'
                 when ${v.kind}::text = 'gone' or endpoints.disabled_at is not null then 'abandoned'
                 when ${v.retrying}::boolean then 'pending'
                 else 'failed'
               end as status
        from gateway.webhook_endpoints as endpoints
        where endpoints.id = ${v.endpoint_id}
      ) as next
      where messages.id = ${v.message_id} and messages.tries = ${v.try_number} and messages.status = 'delivering'
      returning messages.id, messages.status, messages.next_try_at
    ), abandoned as (
      update gateway.webhook_messages as messages
      set status = 'abandoned', next_try_at = null, finished_at = now()
      from disabled
      where messages.endpoint_id = disabled.id and messages.status = 'pending'
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${sql.lit(DELIVER_WEBHOOK)}, json_build_object('message_id', message.id, 'endpoint_id', ${v.endpoint_id}::text),
                   null, message.next_try_at, null, null, null, null)::graphile_worker.job_spec
        from message where message.status = 'pending'
      ))
      where exists (select from message where message.status = 'pending')
    )
    select message.status from (select 1) as one
    cross join queued
    left join message on true
  `,
);

/**
 * Records how a try ended, in one statement: its row in webhook_deliveries, and its message:
 * delivered; pending again with a deliver_webhook job due at its next try; failed, the schedule
 * spent; or abandoned, its endpoint disabled (by this 410, or meanwhile by another's: then only
 * a 2xx still counts). A 410 also disables the endpoint and abandons its pending messages.
 * Guarded by the message still being delivering this very try: a try that the sweep handed back
 * (its worker presumed dead) changes nothing of its message. Returns the message's new status,
 * or undefined when the try was no longer its own.
 *
 * The endpoint: a try with no answer in time makes it back off (paused for the first wait of
 * `backoff`), or, if it was already backing off when the try started (the try was its probe),
 * doubles its wait; tries that started before the last time-out and time out too change nothing.
 * A try that ended otherwise ends its backoff. A 429 or 503 with retry-after (`pauseMs`) pauses
 * it for that long (paused_until, without backoff_ms): no claim takes its messages before then.
 * Neither shortens such a pause: only its time ends it.
 */
export async function finishTry(db: Db, end: TryEnd, backoff: EndpointBackoff): Promise<WebhookMessageStatus | undefined> {
  const { rows } = await finishTryStatement.execute(db, {
    outcome: end.kind === 'delivered' ? 'succeeded' : 'failed',
    http_status: end.httpStatus,
    error: end.error,
    duration_ms: end.durationMs,
    message_id: end.messageId,
    try_number: end.tryNumber,
    gone: end.kind === 'gone',
    timed_out: end.timedOut ?? null,
    backoff_min_ms: backoff.minMs,
    backoff_max_ms: backoff.maxMs,
    endpoint_id: end.endpointId,
    retry_in_ms: end.retryInMs ?? 0,
    kind: end.kind,
    retrying: end.kind === 'failed' && end.retryInMs !== undefined,
    spends_retry: end.kind === 'failed' && (end.spendsRetry ?? true),
    pause_ms: end.pauseMs ?? null,
  });
  return rows[0]?.status ?? undefined;
}

/** Adds a deliver_webhook job for the message, due in `delayMs`: a try this worker cannot make now. */
export async function addDeliveryJob(db: Db, messageId: string, endpointId: string, delayMs: number): Promise<void> {
  await sql`
    select graphile_worker.add_job(${DELIVER_WEBHOOK}, json_build_object('message_id', ${messageId}::text, 'endpoint_id', ${endpointId}::text),
                                   run_at => now() + ${delayMs}::float8 * interval '1 millisecond')
  `.execute(db);
}

/**
 * The tail of a hand-back, after the CTE `lost` (the messages delivering to hand back, locked:
 * their id and tries): each try is recorded as failed, saying `error`, and its message is pending
 * again, due now, with a deliver_webhook job (abandoned if its endpoint was disabled meanwhile).
 * Selects how many were handed back (`recovered`).
 */
function handBack(error: string): RawBuilder<{ recovered: string }> {
  return sql<{ recovered: string }>`
    tries as (
      update gateway.webhook_deliveries as deliveries
      set outcome = 'failed', finished_at = now(), error = ${error}
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
      returning messages.id, messages.endpoint_id, messages.status
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${DELIVER_WEBHOOK}, json_build_object('message_id', recovered.id, 'endpoint_id', recovered.endpoint_id), null, null,
                   null, null, null, null)::graphile_worker.job_spec
        from recovered where recovered.status = 'pending'
      ))
      where exists (select from recovered where recovered.status = 'pending')
    )
    select count(*) as recovered from recovered cross join queued`;
}

/**
 * Hands back the tries of workers that died: messages delivering whose worker has no row in
 * gateway.worker_pools (deleted as dead, or never written), whose try started more than
 * `deadAfterMs` ago (so a worker starting up is not taken for a dead one) or, however recent,
 * of a worker in `dead` (whose row the caller's sweep has just deleted); never those of the
 * workers in `live`. Each try is recorded as failed, and its message is pending again, due now,
 * with a deliver_webhook job (abandoned if its endpoint was disabled meanwhile). Returns how many.
 */
export async function recoverLostDeliveries(
  db: Db,
  deadAfterMs: number,
  live: readonly string[],
  limit: number,
  dead: readonly string[] = [],
): Promise<number> {
  const { rows } = await sql<{ recovered: string }>`
    with lost as (
      select messages.id, messages.tries
      from gateway.webhook_messages as messages
      where messages.status = 'delivering'
        and not exists (select from gateway.worker_pools where worker_pools.id = messages.worker_id)
        and coalesce(messages.worker_id, '') <> all(${live}::text[])
        and (messages.worker_id = any(${dead}::text[]) or exists (
          select from gateway.webhook_deliveries as deliveries
          where deliveries.message_id = messages.id and deliveries.try_number = messages.tries
            and deliveries.started_at < now() - ${deadAfterMs}::float8 * interval '1 millisecond'
        ))
      limit ${limit}
      for update of messages skip locked
    ), ${handBack('the worker stopped during the try')}
  `.execute(db);
  return Number(rows[0]?.recovered ?? 0);
}

/**
 * Hands back the tries of a live worker, `workerId`, that it has lost track of: messages
 * delivering under its id whose try started more than `olderThanMs` ago (so that a claim whose
 * answer is still on its way to the worker is left to it), but for those of `inFlight` (its
 * tries under way). Handed back as recoverLostDeliveries hands back a dead worker's. Returns how
 * many.
 */
export async function recoverForgottenDeliveries(
  db: Db,
  workerId: string,
  olderThanMs: number,
  inFlight: readonly string[],
  limit: number,
): Promise<number> {
  const { rows } = await sql<{ recovered: string }>`
    with old as materialized (
      -- Few, and only these are compared with the tries under way, however many there are.
      select messages.id, messages.tries
      from gateway.webhook_messages as messages
      join gateway.webhook_deliveries as deliveries
        on deliveries.message_id = messages.id and deliveries.try_number = messages.tries
      where messages.status = 'delivering' and messages.worker_id = ${workerId}
        and deliveries.started_at < now() - ${olderThanMs}::float8 * interval '1 millisecond'
    ), lost as (
      select messages.id, messages.tries
      from gateway.webhook_messages as messages
      join old on old.id = messages.id and old.tries = messages.tries
      where old.id <> all(${inFlight}::text[]) and messages.status = 'delivering' and messages.worker_id = ${workerId}
      limit ${limit}
      for update of messages skip locked
    ), ${handBack('the worker lost track of the try')}
  `.execute(db);
  return Number(rows[0]?.recovered ?? 0);
}
