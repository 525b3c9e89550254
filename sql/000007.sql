-- 000007: what 000005 became after it had been released. Stop-7 databases applied its first
-- version; 000005 is that version again, and this migration brings every database to the
-- same schema (a database that applied the later 000005 already has most of it; nothing here
-- harms it).

-- Unfinished requests are few (a queue), so this index stays small; it serves the
-- queue-depth metric and gateway.waiting_requests. It is keyed on finished_at rather than
-- status so that the updates of a request's life before its end (processing, retrying)
-- change no indexed column and can be HOT updates, which the fillfactor leaves room for.
-- Rebuilt only where it still has 000005's first predicate.
do $$
begin
  if not exists (
    select from pg_indexes
    where schemaname = 'gateway' and indexname = 'requests_unfinished' and indexdef like '%finished_at IS NULL%'
  ) then
    drop index if exists gateway.requests_unfinished;
    create index requests_unfinished on gateway.requests (created_at) where finished_at is null;
  end if;
end;
$$;
alter table gateway.requests set (fillfactor = 80);

-- gateway.recent_errors reads a primary-key range instead (below).
drop index if exists gateway.request_attempts_failed;

-- Request ids begin with their creation time in milliseconds (8 base62 digits), so "created
-- since" is a range of the primary key, here and in gateway.request_attempts.
create or replace function gateway.request_id_floor(since timestamptz) returns text
  language plpgsql immutable strict
  as $$
declare
  alphabet constant text := '0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz';
  rest bigint := floor(extract(epoch from since) * 1000)::bigint;
  digits text := '';
begin
  for i in 1..8 loop
    digits := substr(alphabet, (rest % 62)::int + 1, 1) || digits;
    rest := rest / 62;
  end loop;
  return 'req_' || digits;
end;
$$;
comment on function gateway.request_id_floor(timestamptz) is
  'The smallest id of a request created at that time: "where id >= gateway.request_id_floor(now() - interval ''1 hour'')" '
  'selects the requests of the last hour through the primary key.';

create or replace view gateway.waiting_requests as
  select requests.id, projects.name as project, requests.mode, requests.status, requests.attempts,
         requests.last_error_code, requests.model, requests.created_at,
         date_trunc('second', now() - requests.created_at) as waiting_for, requests.next_attempt_at
  from gateway.requests
  join gateway.projects on projects.id = requests.project_id
  where requests.finished_at is null
  order by requests.created_at;

create or replace view gateway.recent_errors as
  select attempts.error_code, requests.mode, count(*) as failed_attempts,
         count(distinct attempts.request_id) as requests, max(attempts.finished_at) as last_seen_at
  from gateway.request_attempts as attempts
  join gateway.requests on requests.id = attempts.request_id
  -- (attempts of requests created in the last day: a primary-key range, however large the table)
  where attempts.request_id >= gateway.request_id_floor(now() - interval '1 day')
    and attempts.outcome = 'failed' and attempts.finished_at > now() - interval '1 hour'
  group by attempts.error_code, requests.mode
  order by failed_attempts desc, attempts.error_code;
