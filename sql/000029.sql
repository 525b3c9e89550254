-- 000029: a webhook message's place in WEBHOOK_RETRY_SCHEDULE is the number of its tries that
-- failed, not of all its tries: a try that its worker lost (the worker died, shut down, or lost
-- track of it) is made again at once in its place and spends no retry, so the endpoint still
-- gets the first try and one retry per wait of the schedule, each after the wait its own
-- failures call for.

alter table gateway.webhook_messages
  add column failures integer not null default 0 constraint webhook_messages_failures check (failures >= 0);
comment on column gateway.webhook_messages.failures is
  'Tries that failed and spent a wait of WEBHOOK_RETRY_SCHEDULE (its place in the schedule): not those its worker lost '
  '(died, shut down, or lost track of), which are made again at once.';

-- Messages still to deliver: their failed tries, but for those their worker lost.
update gateway.webhook_messages as messages
set failures = (
  select count(*) from gateway.webhook_deliveries as deliveries
  where deliveries.message_id = messages.id and deliveries.outcome = 'failed'
    and deliveries.error not in ('the worker stopped during the try', 'the worker shut down during the try',
                                 'the worker lost track of the try')
)
where messages.finished_at is null and messages.tries > 0;
