-- 000009: cancelling requests, and webhooks.
--
-- cancelled is a terminal status: a queued or retrying request becomes cancelled at once; a
-- processing one too, its running attempt recorded as cancelled, and the worker that holds its
-- call aborts it when it hears of the request's end (gateway_requests_finished).
--
-- Webhooks: projects register endpoints; the transaction that makes a request terminal also
-- writes a message for each endpoint of its project that takes the event, and a job to deliver
-- it (the trigger below), so that no terminal request misses its event and no rolled-back one
-- sends one. Each try of a delivery is a row.

alter table gateway.requests
  drop constraint requests_status,
  add constraint requests_status
    check (status in ('queued', 'processing', 'retrying', 'completed', 'failed', 'cancelled')),
  drop constraint requests_finished_when_terminal,
  add constraint requests_finished_when_terminal
    check ((status in ('completed', 'failed', 'cancelled')) = (finished_at is not null));
comment on column gateway.requests.status is
  'queued -> processing -> completed | retrying | failed; retrying -> processing; queued | retrying | processing -> cancelled. '
  'completed, failed and cancelled never change.';
comment on column gateway.requests.finished_at is 'When the request reached completed, failed or cancelled.';

alter table gateway.request_attempts
  drop constraint request_attempts_outcome,
  add constraint request_attempts_outcome check (outcome in ('running', 'succeeded', 'failed', 'cancelled'));
comment on column gateway.request_attempts.outcome is
  'running while the call is under way, then succeeded, failed, or cancelled (its request was cancelled meanwhile).';

create or replace function gateway.notify_requests_finished() returns trigger
  language plpgsql
  as $$
begin
  perform pg_notify('gateway_requests_finished', string_agg(id, ','))
  from (
    select finished.id, (row_number() over ()) / 250 as chunk
    from finished
    join previous using (id)
    where finished.status in ('completed', 'failed', 'cancelled')
      and previous.status not in ('completed', 'failed', 'cancelled')
  ) as newly_finished
  group by chunk;
  return null;
end;
$$;
comment on function gateway.notify_requests_finished() is
  'Sends NOTIFY gateway_requests_finished with the ids of requests an UPDATE has just made terminal '
  '(waiters answer them; a worker aborts the call of one cancelled).';

create table gateway.webhook_endpoints (
  id text collate "C" primary key
    constraint webhook_endpoints_id_format check (id ~ '^whe_[A-Za-z0-9]{20,40}$'),
  project_id bigint not null references gateway.projects (id) on delete cascade,
  url text not null,
  events text[] not null
    constraint webhook_endpoints_events check (
      cardinality(events) >= 1
      and events <@ array['request.completed', 'request.failed', 'request.cancelled']::text[]
    ),
  secret_ciphertext bytea not null,
  previous_secret_ciphertext bytea,
  previous_secret_expires_at timestamptz,
  created_at timestamptz not null default now(),
  disabled_at timestamptz,
  disabled_reason text,
  constraint webhook_endpoints_previous_secret check ((previous_secret_ciphertext is null) = (previous_secret_expires_at is null))
);
comment on table gateway.webhook_endpoints is
  'Where a project''s requests are reported when they end (gateway webhooks add). Both modes'' requests are reported.';
comment on column gateway.webhook_endpoints.id is 'Public handle of the endpoint, used by gateway webhooks remove | rotate-secret.';
comment on column gateway.webhook_endpoints.events is 'The events it takes: request.completed, request.failed, request.cancelled.';
comment on column gateway.webhook_endpoints.secret_ciphertext is
  'The endpoint''s signing secret (whsec_...), AES-256-GCM encrypted with SECRET_ENCRYPTION_KEY.';
comment on column gateway.webhook_endpoints.previous_secret_ciphertext is
  'The secret before the last rotation, encrypted: it keeps signing beside the new one until previous_secret_expires_at.';
comment on column gateway.webhook_endpoints.disabled_at is 'Set when the endpoint answered 410 Gone: nothing more is sent to it.';
comment on column gateway.webhook_endpoints.disabled_reason is 'Why it was disabled.';

create index webhook_endpoints_project on gateway.webhook_endpoints (project_id) where disabled_at is null;

create table gateway.webhook_messages (
  id text collate "C" primary key
    constraint webhook_messages_id_format check (id ~ '^msg_[A-Za-z0-9]{20,40}$'),
  endpoint_id text collate "C" not null references gateway.webhook_endpoints (id) on delete cascade,
  request_id text collate "C" not null references gateway.requests (id) on delete cascade,
  event_type text not null
    constraint webhook_messages_event_type check (event_type in ('request.completed', 'request.failed', 'request.cancelled')),
  created_at timestamptz not null default now(),
  status text not null default 'pending'
    constraint webhook_messages_status check (status in ('pending', 'delivering', 'delivered', 'failed', 'abandoned')),
  tries integer not null default 0 constraint webhook_messages_tries check (tries >= 0),
  next_try_at timestamptz,
  worker_id text,
  finished_at timestamptz,
  constraint webhook_messages_once unique (endpoint_id, request_id, event_type),
  constraint webhook_messages_finished_when_done
    check ((status in ('delivered', 'failed', 'abandoned')) = (finished_at is not null))
);
comment on table gateway.webhook_messages is
  'One event for one endpoint: written in the transaction that made its request terminal, then delivered (at least once).';
comment on column gateway.webhook_messages.id is 'The webhook-id header of every try: the same across retries, so receivers can deduplicate.';
comment on column gateway.webhook_messages.created_at is 'When the request ended: the body''s timestamp.';
comment on column gateway.webhook_messages.status is
  'pending (a try is due at next_try_at), delivering (a try is under way, by worker_id), delivered (a 2xx), '
  'failed (no 2xx after every retry), abandoned (the endpoint was disabled or removed).';
comment on column gateway.webhook_messages.tries is 'Tries started so far.';
comment on column gateway.webhook_messages.worker_id is 'The worker process making the try under way (gateway.worker_pools.id while it lives).';

create index webhook_messages_request on gateway.webhook_messages (request_id);
create index webhook_messages_unfinished on gateway.webhook_messages (created_at) where finished_at is null;
create index webhook_messages_delivering on gateway.webhook_messages (worker_id) where status = 'delivering';

create table gateway.webhook_deliveries (
  message_id text collate "C" not null references gateway.webhook_messages (id) on delete cascade,
  try_number integer not null constraint webhook_deliveries_try_number check (try_number >= 1),
  started_at timestamptz not null default now(),
  finished_at timestamptz,
  outcome text not null default 'running'
    constraint webhook_deliveries_outcome check (outcome in ('running', 'succeeded', 'failed')),
  http_status integer,
  error text,
  duration_ms integer,
  primary key (message_id, try_number),
  constraint webhook_deliveries_finished_when_done check ((outcome = 'running') = (finished_at is null))
);
comment on table gateway.webhook_deliveries is 'One row per try to deliver a webhook message.';
comment on column gateway.webhook_deliveries.outcome is 'running while the try is under way, then succeeded (a 2xx) or failed.';
comment on column gateway.webhook_deliveries.http_status is 'The status the endpoint answered, if it answered.';
comment on column gateway.webhook_deliveries.error is 'Why the try failed, in the gateway''s words (no answer in 15 s, connection refused, HTTP 500, ...).';

-- The messages of the requests an UPDATE has just made terminal, for each endpoint of their
-- project that takes the event, and one job to deliver each, in the same transaction.
create function gateway.enqueue_webhooks() returns trigger
  language plpgsql
  as $$
declare
  queued bigint;
begin
  with ended as (
    select finished.id, finished.project_id, 'request.' || finished.status as event_type
    from finished
    join previous using (id)
    where finished.status in ('completed', 'failed', 'cancelled')
      and previous.status not in ('completed', 'failed', 'cancelled')
      -- (most projects have no endpoint: one index probe each, then nothing)
      and exists (
        select from gateway.webhook_endpoints
        where webhook_endpoints.project_id = finished.project_id and webhook_endpoints.disabled_at is null
      )
  ), messages as (
    insert into gateway.webhook_messages (id, endpoint_id, request_id, event_type, next_try_at)
    select 'msg_' || replace(gen_random_uuid()::text, '-', ''), endpoints.id, ended.id, ended.event_type, now()
    from ended
    join gateway.webhook_endpoints as endpoints
      on endpoints.project_id = ended.project_id and endpoints.disabled_at is null
     and ended.event_type = any(endpoints.events)
    on conflict on constraint webhook_messages_once do nothing
    returning id
  )
  select count(*) into queued
  from graphile_worker.add_jobs(array(
    select row('deliver_webhook', json_build_object('message_id', messages.id), null, null, null, null, null, null)
             ::graphile_worker.job_spec
    from messages
  ))
  where exists (select from messages);
  return null;
end;
$$;
comment on function gateway.enqueue_webhooks() is
  'Writes the webhook messages of requests an UPDATE has just made terminal, and their delivery jobs, in its transaction.';

create trigger requests_enqueue_webhooks
  after update on gateway.requests
  referencing new table as finished old table as previous
  for each statement
  execute function gateway.enqueue_webhooks();

create view gateway.failing_webhook_endpoints as
  select endpoints.id, projects.name as project, endpoints.url, endpoints.disabled_at, endpoints.disabled_reason,
         (select count(*) from gateway.webhook_messages as messages
          where messages.endpoint_id = endpoints.id and messages.finished_at is null) as pending_messages,
         (select min(messages.created_at) from gateway.webhook_messages as messages
          where messages.endpoint_id = endpoints.id and messages.finished_at is null) as oldest_pending_at,
         last_failure.started_at as last_failure_at, last_failure.http_status as last_failure_status,
         last_failure.error as last_failure_error
  from gateway.webhook_endpoints as endpoints
  join gateway.projects on projects.id = endpoints.project_id
  left join lateral (
    select deliveries.started_at, deliveries.http_status, deliveries.error
    from gateway.webhook_messages as messages
    join gateway.webhook_deliveries as deliveries on deliveries.message_id = messages.id
    where messages.endpoint_id = endpoints.id and deliveries.outcome = 'failed'
      and deliveries.started_at > now() - interval '1 day'
    order by deliveries.started_at desc
    limit 1
  ) as last_failure on true
  where endpoints.disabled_at is not null
     or exists (select from gateway.webhook_messages as messages
                where messages.endpoint_id = endpoints.id and messages.finished_at is null and messages.tries > 0);
comment on view gateway.failing_webhook_endpoints is
  'Endpoints that failed a try in the last day and still have messages to deliver, or that are disabled; with their last failure.';
comment on column gateway.failing_webhook_endpoints.pending_messages is 'Messages not delivered yet (or given up).';
comment on column gateway.failing_webhook_endpoints.oldest_pending_at is 'When the oldest of them was written.';
