-- 000006: requests run by the process that accepted them (src/worker/local-attempts.ts).
-- Nothing changes in the tables; their comments say what such a request looks like.

comment on column gateway.requests.status is
  'queued -> processing -> completed | retrying | failed; retrying -> processing. completed and failed never change. '
  'A wait=true request run by the process that accepted it is stored as processing, its first attempt started.';
comment on column gateway.request_attempts.worker_id is
  'The graphile-worker pool that ran the attempt, or local-<host>-<pid>-<n>: the process that accepted the '
  'request and ran its first attempt itself (its job was then a lease, due only if that process died).';
