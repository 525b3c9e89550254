-- 000011: key creation is announced (for the API processes' memory of unknown keys); the
-- secrets' encryption keys may be rotated; what every column says.

-- API processes remember unknown keys for a few seconds (src/keys/cache.ts); a key created
-- meanwhile must work at once, so its creation is announced too, on the channel that announces
-- updates and deletions (000004), as "created:<key id>": it makes them forget the keys they
-- found missing, and nothing else (a bare key id also drops that key from their caches).
create function gateway.notify_api_key_created() returns trigger
  language plpgsql
  as $$
begin
  perform pg_notify('gateway_api_keys_changed', 'created:' || new.id);
  return null;
end;
$$;
comment on function gateway.notify_api_key_created() is
  'Sends NOTIFY gateway_api_keys_changed with "created:<key id>", so API processes forget the keys they found missing.';

create trigger api_keys_notify_created
  after insert on gateway.api_keys
  for each row
  execute function gateway.notify_api_key_created();

-- SECRET_ENCRYPTION_KEYS: secrets are encrypted with the first key, decrypted with any.
comment on column gateway.api_keys.signing_secret_ciphertext is
  'The key''s signing secret, AES-256-GCM encrypted with the first of SECRET_ENCRYPTION_KEYS (or SECRET_ENCRYPTION_KEY), '
  'bound to the key id. `gateway keys reencrypt` encrypts it again with the first key after a rotation.';
comment on column gateway.webhook_endpoints.secret_ciphertext is
  'The endpoint''s signing secret (whsec_...), AES-256-GCM encrypted with the first of SECRET_ENCRYPTION_KEYS '
  '(or SECRET_ENCRYPTION_KEY), bound to the endpoint id.';

-- Every column says what it is.
comment on column gateway.migrations.id is 'The number of the file of sql/ applied (000010.sql: 10).';
comment on column gateway.migrations.applied_at is 'When it was applied.';

comment on column gateway.projects.id is 'Internal id of the project, referred to by its keys, requests and webhook endpoints.';
comment on column gateway.projects.created_at is 'When the project was created (by its first `gateway keys create`).';

comment on column gateway.api_keys.project_id is 'The project the key belongs to: it reads and writes that project''s requests only.';
comment on column gateway.api_keys.created_at is 'When the key was created.';

comment on column gateway.requests.project_id is 'The project of the key that submitted it; only that project''s keys (of the same mode) can read it.';
comment on column gateway.requests.created_at is 'When the request was accepted (its id begins with this time, so ids sort by it).';
comment on column gateway.requests.updated_at is 'When the request last changed: its status, attempts or result.';

comment on column gateway.request_attempts.request_id is 'The request this attempt ran.';
comment on column gateway.request_attempts.started_at is 'When the attempt started.';
comment on column gateway.request_attempts.finished_at is 'When it ended; null while it runs.';

comment on column gateway.signature_nonces.api_key_id is 'The key that signed with the nonce: nonces are unique per key.';
comment on column gateway.signature_nonces.nonce is 'The n= of the Svc-Signature header of a signed POST.';

comment on column gateway.worker_pools.hostname is 'Host name of the machine the worker process runs on.';
comment on column gateway.worker_pools.pid is 'Process id of the worker process on that machine.';
comment on column gateway.worker_pools.started_at is 'When the row was written first: the pool (or worker process) started.';

comment on column gateway.retention_cursors.task is 'The retention task (drop_bodies: BODY_RETENTION_HOURS).';
comment on column gateway.retention_cursors.last_request_id is
  'The last request id the task has passed: it goes on after it (requests before it are done, or were passed over).';

comment on column gateway.lanes.id is 'Internal id of the lane, referred to by requests.lane_id.';
comment on column gateway.lanes.mode is 'live (an upstream) or test (the simulator''s one lane).';
comment on column gateway.lanes.created_at is 'When the first request was routed to the lane.';

comment on column gateway.intake_counters.api_key_id is 'The key whose requests are counted.';
comment on column gateway.intake_counters.kind is 'submit (POST /v1/chat/completions, RATE_LIMIT_RPS) or lookup (GET /v1/requests/{id}, LOOKUP_RATE_LIMIT_RPS).';

comment on column gateway.webhook_endpoints.project_id is 'The project whose requests it is told of (live and test).';
comment on column gateway.webhook_endpoints.url is 'Where events are POSTed: https://, unless WEBHOOK_ALLOW_PRIVATE allows http:// and private addresses.';
comment on column gateway.webhook_endpoints.previous_secret_expires_at is
  'When the previous secret stops signing: 24 hours after the rotation that replaced it.';
comment on column gateway.webhook_endpoints.created_at is 'When the endpoint was added.';

comment on column gateway.webhook_messages.endpoint_id is 'The endpoint it is delivered to.';
comment on column gateway.webhook_messages.request_id is 'The request that ended.';
comment on column gateway.webhook_messages.event_type is 'request.completed, request.failed or request.cancelled: the status the request ended in.';
comment on column gateway.webhook_messages.next_try_at is 'While pending: when the next try is due.';
comment on column gateway.webhook_messages.finished_at is 'When it was delivered, given up (failed) or abandoned; null until then.';

comment on column gateway.webhook_deliveries.message_id is 'The message this try delivered.';
comment on column gateway.webhook_deliveries.try_number is '1 for the first try, then 2, 3, ... (one per WEBHOOK_RETRY_SCHEDULE wait).';
comment on column gateway.webhook_deliveries.started_at is 'When the try started.';
comment on column gateway.webhook_deliveries.finished_at is 'When it ended; null while it runs.';
comment on column gateway.webhook_deliveries.duration_ms is 'How long the try took, to the end of the answer (or the failure).';

-- The views' columns too.
comment on column gateway.request_counts.project is 'Project name.';
comment on column gateway.request_counts.mode is 'live or test.';
comment on column gateway.request_counts.status is 'queued, processing, retrying, completed, failed or cancelled.';

comment on column gateway.waiting_requests.id is 'The request id (req_...).';
comment on column gateway.waiting_requests.project is 'Project name.';
comment on column gateway.waiting_requests.mode is 'live or test.';
comment on column gateway.waiting_requests.status is 'queued, processing or retrying.';
comment on column gateway.waiting_requests.attempts is 'Attempts started so far.';
comment on column gateway.waiting_requests.last_error_code is 'Code of the most recent failed attempt; null if none failed.';
comment on column gateway.waiting_requests.model is 'The requested model.';
comment on column gateway.waiting_requests.created_at is 'When the request was accepted.';

comment on column gateway.recent_errors.error_code is 'Why the attempts failed (upstream_timeout, upstream_server_error, worker_lost, ...).';
comment on column gateway.recent_errors.mode is 'live or test.';

comment on column gateway.attempt_history.request_id is 'The request.';
comment on column gateway.attempt_history.attempt_number is '1 for the first attempt, then 2, 3, ...';
comment on column gateway.attempt_history.outcome is 'running, succeeded, failed, or cancelled (its request was cancelled meanwhile).';
comment on column gateway.attempt_history.error_code is 'Why the attempt failed; null unless failed.';
comment on column gateway.attempt_history.upstream_status is 'HTTP status the upstream answered, if it answered (simulated in test mode).';
comment on column gateway.attempt_history.duration_ms is 'How long the upstream call took.';
comment on column gateway.attempt_history.started_at is 'When the attempt started.';
comment on column gateway.attempt_history.finished_at is 'When it ended; null while it runs.';
comment on column gateway.attempt_history.worker_id is 'The worker process that ran it.';
comment on column gateway.attempt_history.error_detail is 'A short explanation written by the gateway (never the upstream''s own text).';

comment on column gateway.lane_states.id is 'The lane''s id (requests.lane_id).';
comment on column gateway.lane_states.mode is 'live or test.';
comment on column gateway.lane_states.upstream is 'The upstream''s name ("simulator" in test mode).';
comment on column gateway.lane_states.model is 'The model ("*" for the simulator''s one lane).';
comment on column gateway.lane_states.max_concurrent is 'Calls in flight at most, as the last dispatch applied it; null: no limit.';
comment on column gateway.lane_states.requests_per_minute is 'Calls started per minute at most, as the last dispatch applied it; null: no limit.';
comment on column gateway.lane_states.tokens_per_minute is 'Tokens per minute at most, as the last dispatch applied it; null: no limit.';

comment on column gateway.usage_daily.day is 'The day (UTC) the requests completed.';
comment on column gateway.usage_daily.project is 'Project name.';
comment on column gateway.usage_daily.mode is 'live or test.';
comment on column gateway.usage_daily.upstream is 'The upstream that answered ("simulator" in test mode).';
comment on column gateway.usage_daily.model is 'The requested model.';
comment on column gateway.usage_daily.prompt_tokens is 'Sum of usage.prompt_tokens.';
comment on column gateway.usage_daily.completion_tokens is 'Sum of usage.completion_tokens.';

comment on column gateway.failing_webhook_endpoints.id is 'The endpoint''s id (whe_...).';
comment on column gateway.failing_webhook_endpoints.project is 'Project name.';
comment on column gateway.failing_webhook_endpoints.url is 'Where its events are POSTed.';
comment on column gateway.failing_webhook_endpoints.disabled_at is 'Set when it answered 410 Gone: nothing more is sent to it.';
comment on column gateway.failing_webhook_endpoints.disabled_reason is 'Why it was disabled.';
comment on column gateway.failing_webhook_endpoints.last_failure_at is 'When its last failed try of the past day started.';
comment on column gateway.failing_webhook_endpoints.last_failure_status is 'The HTTP status it answered then, if it answered.';
comment on column gateway.failing_webhook_endpoints.last_failure_error is 'Why that try failed, in the gateway''s words.';

-- Views leave ordering to the query that reads them: an order by inside a view sorts every
-- read, even one that counts, filters or orders otherwise. The same views, without it.
create or replace view gateway.request_counts as
  select projects.name as project, requests.mode, requests.status, count(*) as requests,
         min(requests.created_at) as oldest_created_at, max(requests.created_at) as newest_created_at
  from gateway.requests
  join gateway.projects on projects.id = requests.project_id
  group by projects.name, requests.mode, requests.status;

create or replace view gateway.waiting_requests as
  select requests.id, projects.name as project, requests.mode, requests.status, requests.attempts,
         requests.last_error_code, requests.model, requests.created_at,
         date_trunc('second', now() - requests.created_at) as waiting_for, requests.next_attempt_at
  from gateway.requests
  join gateway.projects on projects.id = requests.project_id
  where requests.finished_at is null;
comment on view gateway.waiting_requests is
  'Requests not finished yet (queued, processing, retrying): "order by created_at" for the oldest first.';

create or replace view gateway.recent_errors as
  select attempts.error_code, requests.mode, count(*) as failed_attempts,
         count(distinct attempts.request_id) as requests, max(attempts.finished_at) as last_seen_at
  from gateway.request_attempts as attempts
  join gateway.requests on requests.id = attempts.request_id
  -- (attempts of requests created in the last day: a primary-key range, however large the table)
  where attempts.request_id >= gateway.request_id_floor(now() - interval '1 day')
    and attempts.outcome = 'failed' and attempts.finished_at > now() - interval '1 hour'
  group by attempts.error_code, requests.mode;

create or replace view gateway.attempt_history as
  select attempts.request_id, attempts.attempt_number, attempts.outcome, attempts.error_code,
         attempts.upstream_status, attempts.duration_ms, attempts.started_at, attempts.finished_at,
         attempts.worker_id, attempts.error_detail, requests.status as request_status
  from gateway.request_attempts as attempts
  join gateway.requests on requests.id = attempts.request_id;
comment on view gateway.attempt_history is
  'Every attempt of every request: select * from gateway.attempt_history where request_id = ''req_...'' order by attempt_number.';

-- An endpoint whose first try is in flight has a message with tries = 1 (a try counts from its
-- start) and no failure: it is not failing. Listed: the disabled, and those with messages still
-- to deliver after a failed try of the past day. The same columns.
create or replace view gateway.failing_webhook_endpoints as
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
     or (last_failure.started_at is not null
         and exists (select from gateway.webhook_messages as messages
                     where messages.endpoint_id = endpoints.id and messages.finished_at is null));
comment on column gateway.failing_webhook_endpoints.pending_messages is
  'Messages not finished yet: pending or delivering (delivered, given up and abandoned ones are finished).';

comment on column gateway.webhook_messages.status is
  'pending (a try is due at next_try_at), delivering (a try is under way, by worker_id), delivered (a 2xx), '
  'failed (no 2xx after every retry), abandoned (its endpoint was disabled; removing an endpoint deletes its messages).';
