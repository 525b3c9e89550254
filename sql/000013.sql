-- 000013: request deadlines. Every request has one: accepted at now() + the deadline of the key
-- that sent it, or REQUEST_DEADLINE when the key has none. A request not finished by then fails
-- with last_error_code deadline_exceeded: a worker's expiry (src/worker/deadlines-repository.ts)
-- ends it, and records its running attempt, if any, as failed; the triggers of 000009 then wake
-- its waiters, abort its call wherever it runs, and write its request.failed webhook events.

alter table gateway.api_keys
  add column request_deadline interval
    constraint api_keys_request_deadline_positive check (request_deadline > interval '0');
comment on column gateway.api_keys.request_deadline is
  'How long a request sent with this key may take to finish, from its acceptance (`gateway keys create --deadline`); '
  'null: the server''s REQUEST_DEADLINE.';

alter table gateway.requests add column deadline_at timestamptz;
comment on column gateway.requests.deadline_at is
  'When the request fails with deadline_exceeded if it has not finished: its acceptance plus its key''s deadline, or '
  'REQUEST_DEADLINE. Requests finished before deadlines existed have none.';

-- Requests waiting when this migration runs get the default deadline, counted from their acceptance.
-- Only where there are some: an update fires the statement triggers of gateway.requests, whose
-- webhook trigger calls graphile_worker.add_jobs, and in a new database graphile-worker's schema
-- comes after ours.
do $$
begin
  if exists (select from gateway.requests where finished_at is null) then
    update gateway.requests set deadline_at = created_at + interval '24 hours' where finished_at is null;
  end if;
end;
$$;

-- The expiry's look-up: unfinished requests in deadline order, those past it first. It holds the
-- queue only (finished requests leave it), so it stays small however many requests are kept.
create index requests_deadline on gateway.requests (deadline_at) where finished_at is null;

comment on column gateway.request_attempts.error_code is
  'Why the attempt failed: upstream_timeout, upstream_server_error, worker_lost, deadline_exceeded (its request''s '
  'deadline passed during the call), ...';
