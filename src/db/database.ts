// The tables of the "gateway" schema, as kysely sees them (sql/ is the source of truth).
import type { ColumnType, Generated } from 'kysely';
import type { KeyMode } from '../ids.ts';

type CreatedAt = ColumnType<Date, Date | undefined, never>;
type Timestamp = ColumnType<Date, Date | undefined, Date>;
type NullableTimestamp = ColumnType<Date | null, Date | null | undefined, Date | null>;

export type RequestStatus = 'queued' | 'processing' | 'retrying' | 'completed' | 'failed' | 'cancelled';
export const TERMINAL_STATUSES: readonly RequestStatus[] = ['completed', 'failed', 'cancelled'];

export interface Database {
  migrations: MigrationsTable;
  projects: ProjectsTable;
  api_keys: ApiKeysTable;
  requests: RequestsTable;
  request_attempts: RequestAttemptsTable;
  signature_nonces: SignatureNoncesTable;
  worker_pools: WorkerPoolsTable;
  retention_cursors: RetentionCursorsTable;
  queues: QueuesTable;
  lanes: LanesTable;
  lane_fair_shares: LaneFairSharesTable;
  intake_counters: IntakeCountersTable;
  webhook_endpoints: WebhookEndpointsTable;
  webhook_messages: WebhookMessagesTable;
  webhook_deliveries: WebhookDeliveriesTable;
}

export interface MigrationsTable {
  id: number;
  applied_at: CreatedAt;
}

export interface ProjectsTable {
  /** int8, which node-postgres returns as a string. */
  id: Generated<string>;
  name: string;
  created_at: CreatedAt;
}

export interface ApiKeysTable {
  id: string;
  project_id: string;
  mode: KeyMode;
  key_sha256: Buffer;
  key_hint: string;
  signing_secret_ciphertext: Buffer;
  created_at: CreatedAt;
  revoked_at: NullableTimestamp;
  /** interval: written as text ('900000 milliseconds'); read through extract(epoch from ...), never as it is. */
  request_deadline: ColumnType<unknown, string | null | undefined, never>;
}

export interface RequestsTable {
  id: string;
  project_id: string;
  mode: KeyMode;
  api_key_id: string | null;
  status: ColumnType<RequestStatus, RequestStatus | undefined, RequestStatus>;
  attempts: ColumnType<number, number | undefined, number>;
  last_error_code: string | null;
  model: string;
  /** json: written as JSON text, read back parsed by node-postgres. */
  body: ColumnType<unknown, string, string | null>;
  body_sha256: Buffer;
  idempotency_key: string | null;
  result: ColumnType<unknown, string | undefined, string>;
  created_at: CreatedAt;
  updated_at: Timestamp;
  next_attempt_at: NullableTimestamp;
  finished_at: NullableTimestamp;
  /** Set at acceptance; null only for requests finished before deadlines existed. */
  deadline_at: ColumnType<Date | null, Date | null | undefined, never>;
  /** int8 (a string): the lane of its latest attempt; null before its first (and for requests finished before lanes existed). */
  lane_id: string | null;
  /** int8 (a string): the queue it waits in; null only for requests finished before queues existed. */
  queue_id: string | null;
  charged_attempts: ColumnType<number, number | undefined, number>;
  prompt_tokens_estimate: number | null;
  prompt_tokens: number | null;
  completion_tokens: number | null;
  total_tokens: number | null;
}

export interface RequestAttemptsTable {
  request_id: string;
  attempt_number: number;
  started_at: CreatedAt;
  finished_at: NullableTimestamp;
  outcome: ColumnType<'running' | 'succeeded' | 'failed' | 'cancelled', 'running' | undefined, 'succeeded' | 'failed' | 'cancelled'>;
  upstream_status: number | null;
  error_code: string | null;
  error_detail: string | null;
  duration_ms: number | null;
  worker_id: string | null;
  upstream: string | null;
  charged: boolean | null;
}

export interface SignatureNoncesTable {
  api_key_id: string;
  nonce: string;
  expires_at: Date;
}

export interface WorkerPoolsTable {
  id: string;
  hostname: string;
  pid: number;
  started_at: CreatedAt;
  last_seen_at: Timestamp;
}

export interface RetentionCursorsTable {
  /** The retention task: drop_bodies. */
  task: string;
  last_request_id: string;
}

export interface LanesTable {
  /** int8, which node-postgres returns as a string. */
  id: Generated<string>;
  mode: KeyMode;
  upstream: string;
  model: string;
  max_concurrent: number | null;
  requests_per_minute: number | null;
  tokens_per_minute: number | null;
  request_allowance: number | null;
  token_allowance: number | null;
  refilled_at: NullableTimestamp;
  paused_until: NullableTimestamp;
  last_project_id: string | null;
  created_at: CreatedAt;
  queue_id: string;
  deployment: number | null;
  health: ColumnType<'healthy' | 'open' | 'probing', 'healthy' | 'open' | 'probing' | undefined, 'healthy' | 'open' | 'probing'>;
  health_since: NullableTimestamp;
  failure_streak: ColumnType<number, number | undefined, number>;
  last_failed_request_id: string | null;
  window_started_at: NullableTimestamp;
  window_calls: ColumnType<number, number | undefined, number>;
  window_failures: ColumnType<number, number | undefined, number>;
  probe_interval_ms: number | null;
  probe_at: NullableTimestamp;
  probe_request_id: string | null;
  last_error: string | null;
  last_error_at: NullableTimestamp;
  /** int8, as a string. */
  fair_share_clock: ColumnType<string, string | number | undefined, string | number>;
}

export interface LaneFairSharesTable {
  /** int8, as a string. */
  lane_id: string;
  /** int8, as a string. */
  project_id: string;
  /** int8, as a string. */
  next_start: ColumnType<string, string | number, string | number>;
  started_at: Date;
}

export interface QueuesTable {
  /** int8, which node-postgres returns as a string. */
  id: Generated<string>;
  mode: KeyMode;
  model: string;
  wake_at: NullableTimestamp;
  created_at: CreatedAt;
  /** When an API process last looked it up to route a request (an idle queue is pruned: sql/000016.sql). */
  used_at: Timestamp;
}

export interface IntakeCountersTable {
  api_key_id: string;
  kind: 'submit' | 'lookup';
  process_id: string;
  /** int8, as a string. */
  admitted: ColumnType<string, string | number, string | number>;
  updated_at: Timestamp;
}

export type WebhookEvent = 'request.completed' | 'request.failed' | 'request.cancelled';

export interface WebhookEndpointsTable {
  id: string;
  /** int8, as a string. */
  project_id: string;
  url: string;
  events: WebhookEvent[];
  secret_ciphertext: Buffer;
  previous_secret_ciphertext: Buffer | null;
  previous_secret_expires_at: NullableTimestamp;
  created_at: CreatedAt;
  disabled_at: NullableTimestamp;
  disabled_reason: string | null;
  /** Set while it backs off (a try got no answer in time); null, with the next two, otherwise. */
  backoff_ms: number | null;
  timed_out_at: NullableTimestamp;
  paused_until: NullableTimestamp;
}

export type WebhookMessageStatus = 'pending' | 'delivering' | 'delivered' | 'failed' | 'abandoned';

export interface WebhookMessagesTable {
  id: string;
  endpoint_id: string;
  request_id: string;
  event_type: WebhookEvent;
  created_at: CreatedAt;
  status: ColumnType<WebhookMessageStatus, WebhookMessageStatus | undefined, WebhookMessageStatus>;
  tries: ColumnType<number, number | undefined, number>;
  next_try_at: NullableTimestamp;
  worker_id: string | null;
  finished_at: NullableTimestamp;
}

export interface WebhookDeliveriesTable {
  message_id: string;
  try_number: number;
  started_at: CreatedAt;
  finished_at: NullableTimestamp;
  outcome: ColumnType<'running' | 'succeeded' | 'failed', 'running' | undefined, 'succeeded' | 'failed'>;
  http_status: number | null;
  error: string | null;
  duration_ms: number | null;
}
