-- 000014: one slow webhook endpoint does not hold up the others.
--
-- Each worker process keeps at most WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT tries in flight per
-- endpoint (counted in its memory: src/webhooks/deliverer.ts). An endpoint whose try got no
-- answer within WEBHOOK_TIMEOUT_MS backs off, for every worker: no try starts on it for a second,
-- then one at a time (a probe), the wait doubling after each probe left unanswered, up to a
-- minute; any try it answers (or refuses at once) ends the backoff.
--
-- A message that finds no room (its endpoint's or its worker's) or its endpoint backing off is
-- not tried and keeps its tries: it waits, pending and due, without a job of its own. One
-- wake_webhook_endpoint job per endpoint (its job key, in graphile_worker.jobs) tries the
-- endpoint's waiting messages, oldest first, and is added again, later each time, while some
-- still wait.

alter table gateway.webhook_endpoints
  add column backoff_ms integer constraint webhook_endpoints_backoff_ms check (backoff_ms > 0),
  add column timed_out_at timestamptz,
  add column paused_until timestamptz,
  add constraint webhook_endpoints_backing_off
    check ((backoff_ms is null) = (timed_out_at is null) and (backoff_ms is null) = (paused_until is null));
comment on column gateway.webhook_endpoints.backoff_ms is
  'Set while the endpoint backs off (its last try got no answer within WEBHOOK_TIMEOUT_MS): the wait before its next try, '
  'doubled after each probe left unanswered, 1 s to 1 min; null once a try ends otherwise.';
comment on column gateway.webhook_endpoints.timed_out_at is
  'While it backs off: when a try last got no answer in time. Tries started before then that time out too do not lengthen the wait.';
comment on column gateway.webhook_endpoints.paused_until is
  'While it backs off: no try starts on it before then (the end of the wait, or of the one probe under way).';

-- The messages of an endpoint that are due, oldest first (the wake jobs' claims).
create index webhook_messages_due on gateway.webhook_messages (endpoint_id, next_try_at) where status = 'pending';

-- The delivery jobs name the message's endpoint too: a worker checks the endpoint's room in its
-- memory before it claims the message.
create or replace function gateway.enqueue_webhooks() returns trigger
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
    returning id, endpoint_id
  )
  select count(*) into queued
  from graphile_worker.add_jobs(array(
    select row('deliver_webhook', json_build_object('message_id', messages.id, 'endpoint_id', messages.endpoint_id),
               null, null, null, null, null, null)::graphile_worker.job_spec
    from messages
  ))
  where exists (select from messages);
  return null;
end;
$$;
