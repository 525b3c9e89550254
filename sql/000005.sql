-- 000005: what operators need: views to read the service's state with psql, the indexes that
-- keep those and the metrics cheap, and the cursor of the body-retention task.

-- Unfinished requests are few (a queue), so this index stays small; it serves the
-- queue-depth metric and gateway.waiting_requests.
create index requests_unfinished on gateway.requests (created_at)
  where status in ('queued', 'processing', 'retrying');

create index request_attempts_failed on gateway.request_attempts (finished_at)
  where outcome = 'failed';

create table gateway.retention_cursors (
  task text primary key,
  last_request_id text collate "C" not null
);
comment on table gateway.retention_cursors is
  'How far each retention task has got along the (time-ordered) request ids, so no row is visited twice.';

create view gateway.request_counts as
  select projects.name as project, requests.mode, requests.status, count(*) as requests,
         min(requests.created_at) as oldest_created_at, max(requests.created_at) as newest_created_at
  from gateway.requests
  join gateway.projects on projects.id = requests.project_id
  group by projects.name, requests.mode, requests.status
  order by projects.name, requests.mode, requests.status;
comment on view gateway.request_counts is 'How many requests each project has, by mode and status (a full count: not for every second).';
comment on column gateway.request_counts.requests is 'Number of requests in this project, mode and status.';
comment on column gateway.request_counts.oldest_created_at is 'Creation time of the oldest of them.';
comment on column gateway.request_counts.newest_created_at is 'Creation time of the newest of them.';

create view gateway.waiting_requests as
  select requests.id, projects.name as project, requests.mode, requests.status, requests.attempts,
         requests.last_error_code, requests.model, requests.created_at,
         date_trunc('second', now() - requests.created_at) as waiting_for, requests.next_attempt_at
  from gateway.requests
  join gateway.projects on projects.id = requests.project_id
  where requests.status in ('queued', 'processing', 'retrying')
  order by requests.created_at;
comment on view gateway.waiting_requests is 'Requests not finished yet (queued, processing, retrying), oldest first.';
comment on column gateway.waiting_requests.waiting_for is 'Time since the request was accepted.';
comment on column gateway.waiting_requests.next_attempt_at is 'For a retrying request: when its next attempt is due.';

create view gateway.recent_errors as
  select attempts.error_code, requests.mode, count(*) as failed_attempts,
         count(distinct attempts.request_id) as requests, max(attempts.finished_at) as last_seen_at
  from gateway.request_attempts as attempts
  join gateway.requests on requests.id = attempts.request_id
  where attempts.outcome = 'failed' and attempts.finished_at > now() - interval '1 hour'
  group by attempts.error_code, requests.mode
  order by failed_attempts desc, attempts.error_code;
comment on view gateway.recent_errors is 'Failed attempts of the last hour, by error code and mode.';
comment on column gateway.recent_errors.failed_attempts is 'Attempts that failed with this code in the last hour.';
comment on column gateway.recent_errors.requests is 'Distinct requests those attempts belong to.';
comment on column gateway.recent_errors.last_seen_at is 'When the latest of them ended.';

create view gateway.attempt_history as
  select attempts.request_id, attempts.attempt_number, attempts.outcome, attempts.error_code,
         attempts.upstream_status, attempts.duration_ms, attempts.started_at, attempts.finished_at,
         attempts.worker_id, attempts.error_detail, requests.status as request_status
  from gateway.request_attempts as attempts
  join gateway.requests on requests.id = attempts.request_id
  order by attempts.request_id, attempts.attempt_number;
comment on view gateway.attempt_history is
  'Every attempt of every request, in order: select * from gateway.attempt_history where request_id = ''req_...''.';
comment on column gateway.attempt_history.request_status is 'The request''s status now.';
