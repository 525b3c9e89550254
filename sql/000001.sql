-- 000001: projects, API keys, requests and their attempts.
--
-- Everything lives in the "gateway" schema (the migrator creates it); graphile-worker keeps its
-- queue in its own "graphile_worker" schema. Plain Postgres 13+, no extensions.

create table gateway.projects (
  id bigint generated always as identity primary key,
  name text not null unique
    constraint projects_name_format check (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$'),
  created_at timestamptz not null default now()
);
comment on table gateway.projects is
  'A tenant. Requests belong to one project and are visible to that project''s keys only.';
comment on column gateway.projects.name is 'Name given at `gateway keys create --project <name>`.';

create table gateway.api_keys (
  id text collate "C" primary key
    constraint api_keys_id_format check (id ~ '^key_[A-Za-z0-9]{20,40}$'),
  project_id bigint not null references gateway.projects (id) on delete cascade,
  mode text not null constraint api_keys_mode check (mode in ('live', 'test')),
  key_sha256 bytea not null unique
    constraint api_keys_key_sha256_length check (octet_length(key_sha256) = 32),
  key_hint text not null,
  signing_secret_ciphertext bytea not null,
  created_at timestamptz not null default now(),
  revoked_at timestamptz
);
comment on table gateway.api_keys is
  'Project API keys. The key itself is never stored: only its SHA-256, and its last four characters as a hint.';
comment on column gateway.api_keys.id is 'Public handle of the key, used by `gateway keys revoke <id>`.';
comment on column gateway.api_keys.mode is 'live keys call the upstream provider; test keys use the built-in simulator.';
comment on column gateway.api_keys.key_sha256 is 'SHA-256 of the full key (svc_live_... / svc_test_...).';
comment on column gateway.api_keys.key_hint is 'Last four characters of the key, to tell keys apart in listings.';
comment on column gateway.api_keys.signing_secret_ciphertext is
  'The key''s signing secret, AES-256-GCM encrypted with the server''s SECRET_ENCRYPTION_KEY.';
comment on column gateway.api_keys.revoked_at is 'Set when the key was revoked; a revoked key authenticates nothing.';

create index api_keys_project on gateway.api_keys (project_id);

create table gateway.requests (
  id text collate "C" primary key
    constraint requests_id_format check (id ~ '^req_[A-Za-z0-9]{20,40}$'),
  project_id bigint not null references gateway.projects (id) on delete cascade,
  mode text not null constraint requests_mode check (mode in ('live', 'test')),
  api_key_id text collate "C" references gateway.api_keys (id) on delete set null,
  status text not null default 'queued'
    constraint requests_status check (status in ('queued', 'processing', 'retrying', 'completed', 'failed')),
  attempts integer not null default 0 constraint requests_attempts check (attempts >= 0),
  last_error_code text,
  model text not null,
  body json,
  body_sha256 bytea not null,
  idempotency_key text,
  result json,
  created_at timestamptz not null default now(),
  updated_at timestamptz not null default now(),
  next_attempt_at timestamptz,
  finished_at timestamptz,
  constraint requests_result_when_completed check ((status = 'completed') = (result is not null)),
  constraint requests_finished_when_terminal check ((status in ('completed', 'failed')) = (finished_at is not null))
);
comment on table gateway.requests is
  'One row per accepted chat completion request: its lifecycle, and its result once completed.';
comment on column gateway.requests.id is 'Service request id (req_...), as returned to the client.';
comment on column gateway.requests.mode is 'Mode of the key that submitted it; only keys of the same project and mode can read it.';
comment on column gateway.requests.api_key_id is 'The key that submitted the request.';
comment on column gateway.requests.status is
  'queued -> processing -> completed | retrying | failed; retrying -> processing. completed and failed never change.';
comment on column gateway.requests.attempts is 'Attempts started so far, including one lost with a crashed worker.';
comment on column gateway.requests.last_error_code is
  'Code of the most recent failed attempt (kept after a later success); null if no attempt failed.';
comment on column gateway.requests.model is 'The requested model, copied out of the body for easy grouping.';
comment on column gateway.requests.body is 'What is sent upstream: the submitted body without wait, idempotency_key and stream.';
comment on column gateway.requests.body_sha256 is 'SHA-256 of body; a repeated idempotency key must come with the same body.';
comment on column gateway.requests.idempotency_key is 'Client-chosen key, unique per project and mode.';
comment on column gateway.requests.result is 'The upstream chat completion, verbatim; present exactly when completed.';
comment on column gateway.requests.next_attempt_at is 'When retrying: when the next attempt is due.';
comment on column gateway.requests.finished_at is 'When the request reached completed or failed.';

create unique index requests_idempotency_key on gateway.requests (project_id, mode, idempotency_key)
  where idempotency_key is not null;
create index requests_project_created on gateway.requests (project_id, mode, created_at);

create table gateway.request_attempts (
  request_id text collate "C" not null references gateway.requests (id) on delete cascade,
  attempt_number integer not null constraint request_attempts_number check (attempt_number >= 1),
  started_at timestamptz not null default now(),
  finished_at timestamptz,
  outcome text not null default 'running'
    constraint request_attempts_outcome check (outcome in ('running', 'succeeded', 'failed')),
  upstream_status integer,
  error_code text,
  error_detail text,
  duration_ms integer,
  worker_id text,
  primary key (request_id, attempt_number),
  constraint request_attempts_error_when_failed check ((outcome = 'failed') = (error_code is not null)),
  constraint request_attempts_finished_when_done check ((outcome = 'running') = (finished_at is null))
);
comment on table gateway.request_attempts is 'One row per attempt to run a request against the upstream provider.';
comment on column gateway.request_attempts.attempt_number is '1 for the first attempt, then 2, 3, ... up to MAX_ATTEMPTS.';
comment on column gateway.request_attempts.outcome is 'running while the call is under way, then succeeded or failed.';
comment on column gateway.request_attempts.upstream_status is 'HTTP status the upstream answered, if it answered (simulated in test mode).';
comment on column gateway.request_attempts.error_code is 'Why the attempt failed: upstream_timeout, upstream_server_error, worker_lost, ...';
comment on column gateway.request_attempts.error_detail is 'A short explanation written by the gateway (never the upstream''s own text).';
comment on column gateway.request_attempts.duration_ms is 'How long the upstream call took.';
comment on column gateway.request_attempts.worker_id is 'The graphile-worker pool that ran the attempt.';

-- Waiting wait=true requests LISTEN on this channel. The payload is a comma-separated list of
-- request ids that have just reached completed or failed (at most 250 per notification, well
-- under the 8000-byte payload limit).
create function gateway.notify_requests_finished() returns trigger
  language plpgsql
  as $$
begin
  perform pg_notify('gateway_requests_finished', string_agg(id, ','))
  from (
    select finished.id, (row_number() over ()) / 250 as chunk
    from finished
    join previous using (id)
    where finished.status in ('completed', 'failed')
      and previous.status not in ('completed', 'failed')
  ) as newly_finished
  group by chunk;
  return null;
end;
$$;
comment on function gateway.notify_requests_finished() is
  'Sends NOTIFY gateway_requests_finished with the ids of requests an UPDATE has just made terminal.';

create trigger requests_notify_finished
  after update on gateway.requests
  referencing new table as finished old table as previous
  for each statement
  execute function gateway.notify_requests_finished();
