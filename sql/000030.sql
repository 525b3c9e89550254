-- 000030: a webhook try that a worker could not sign (none of its SECRET_ENCRYPTION_KEY(S) is the
-- key the endpoint's secret is stored with, as during a key rotation) never reaches the endpoint:
-- like a try its worker lost, it spends no wait of WEBHOOK_RETRY_SCHEDULE. It is made again
-- later, each time later, by whichever worker takes it, until the event is older than the whole
-- schedule: then the event is given up (failed), as one whose schedule is spent.

comment on column gateway.webhook_messages.failures is
  'Tries that failed and spent a wait of WEBHOOK_RETRY_SCHEDULE (its place in the schedule): not those its worker lost '
  '(died, shut down, or lost track of), which are made again at once, nor those its worker could not sign (it lacked the '
  'key of the endpoint''s secret), which are made again later, until the event is older than the whole schedule.';
