// The tables and views of the "gateway" schema, as kysely sees them: the types kysely-codegen
// generates from the migrated schema (schema.generated.ts; sql/ is the source of truth), with what
// their SQL types cannot say added here: which values a text column takes (its check constraint),
// and that json columns are written as JSON text.
import type { ColumnType } from 'kysely';
import type { KeyMode } from '../ids.ts';
import type {
  ApiKeys,
  DB,
  IntakeCounters,
  Json,
  Lanes,
  Queues,
  RequestAttempts,
  Requests,
  WebhookDeliveries,
  WebhookEndpoints,
  WebhookMessages,
} from './schema.generated.ts';

export type RequestStatus = 'queued' | 'processing' | 'retrying' | 'completed' | 'failed' | 'cancelled';
export const TERMINAL_STATUSES: readonly RequestStatus[] = ['completed', 'failed', 'cancelled'];

/** What gateway.intake_counters counts: submissions, lookups (and cancels), and the bytes of submissions' bodies. */
export type IntakeKind = 'submit' | 'lookup' | 'bytes';

export type WebhookEvent = 'request.completed' | 'request.failed' | 'request.cancelled';
export type WebhookMessageStatus = 'pending' | 'delivering' | 'delivered' | 'failed' | 'abandoned';

export interface Database extends Omit<DB, keyof Refined>, Refined {}

export type RequestsTable = Database['requests'];
export type RequestAttemptsTable = Database['request_attempts'];
export type WebhookEndpointsTable = Database['webhook_endpoints'];
export type WebhookMessagesTable = Database['webhook_messages'];

/** The tables whose columns say more than their SQL types. */
interface Refined {
  api_keys: Refine<ApiKeys, { mode: KeyMode }>;
  requests: Refine<
    Requests,
    {
      mode: KeyMode;
      status: WithDefault<RequestStatus>;
      // json, written as JSON text (node-postgres sends a string as it is, where it would send an
      // array as a Postgres array) and read back parsed.
      body: ColumnType<Json | null, string, string | null>;
      result: ColumnType<Json | null, string | undefined, string>;
    }
  >;
  request_attempts: Refine<
    RequestAttempts,
    { outcome: ColumnType<'running' | 'succeeded' | 'failed' | 'cancelled', 'running' | undefined, 'succeeded' | 'failed' | 'cancelled'> }
  >;
  lanes: Refine<Lanes, { mode: KeyMode; health: WithDefault<'healthy' | 'open' | 'probing'> }>;
  queues: Refine<Queues, { mode: KeyMode }>;
  intake_counters: Refine<IntakeCounters, { kind: IntakeKind }>;
  webhook_endpoints: Refine<WebhookEndpoints, { events: WebhookEvent[] }>;
  webhook_messages: Refine<WebhookMessages, { event_type: WebhookEvent; status: WithDefault<WebhookMessageStatus> }>;
  webhook_deliveries: Refine<
    WebhookDeliveries,
    { outcome: ColumnType<'running' | 'succeeded' | 'failed', 'running' | undefined, 'succeeded' | 'failed'> }
  >;
}

/** `Table` with the types of some of its columns replaced; a name that is not one of its columns fails. */
type Refine<Table, Columns extends { [Column in keyof Columns]: Column extends keyof Table ? unknown : never }> =
  Omit<Table, keyof Columns> & Columns;

/** A column with a default: optional when inserting. */
type WithDefault<Value> = ColumnType<Value, Value | undefined, Value>;
