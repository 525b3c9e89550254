-- 000018: RATE_LIMIT_BYTES_PER_SECOND, the bytes of request bodies each API key may send per
-- second, counted across API processes in gateway.intake_counters as the request rates are.

alter table gateway.intake_counters drop constraint intake_counters_kind;
alter table gateway.intake_counters
  add constraint intake_counters_kind check (kind in ('submit', 'lookup', 'bytes'));

comment on table gateway.intake_counters is
  'What each API process has admitted for each key since it started (submissions, lookups and body bytes apart), '
  'so that every process counts the others'' towards the per-key rate limits. Rows of processes gone for a minute are deleted.';
comment on column gateway.intake_counters.kind is
  'submit (POST /v1/chat/completions, RATE_LIMIT_RPS), lookup (GET /v1/requests/{id} and cancels, LOOKUP_RATE_LIMIT_RPS) '
  'or bytes (the bodies of submissions, RATE_LIMIT_BYTES_PER_SECOND).';
comment on column gateway.intake_counters.admitted is 'How many it has admitted for this key so far: requests, or bytes for kind bytes.';
