-- 000017: the webhook views and comments that 000011 gained after it was released.
--
-- A database that ran the first version of 000011 lacks them; one that ran the later version
-- has them already, and this makes them again, the same.

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
