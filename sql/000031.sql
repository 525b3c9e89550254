-- 000031: a webhook endpoint that answers 429 or 503 with retry-after is paused for that long,
-- for every worker: none of its events is tried before then (each keeps its retries), rather
-- than each meeting the same refusal. The pause is webhook_endpoints.paused_until, which the
-- backoff of an endpoint that times out (sql/000014.sql) sets too; set without backoff_ms, it is
-- such a pause, after which every waiting event goes (no probe first).

alter table gateway.webhook_endpoints
  drop constraint webhook_endpoints_backing_off,
  add constraint webhook_endpoints_backing_off
    check ((backoff_ms is null) = (timed_out_at is null) and (backoff_ms is null or paused_until is not null));
comment on column gateway.webhook_endpoints.paused_until is
  'No try starts on it before then: while it backs off, the end of the wait (or of the one probe under way); '
  'otherwise, the end of the retry-after it last sent with a 429 or 503.';
