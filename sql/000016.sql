-- 000016: queues and lanes that nothing uses are deleted.
--
-- A model's queue and its lanes are created on its first request. An upstream whose models hold a
-- pattern (`o3*`, `*`) lets clients name models of their own, each a queue and lanes: the API
-- creates at most MAX_PATTERN_MODELS queues for models that no upstream lists by name (counted
-- only when it would create one: lanes/repository.ts), and the workers delete the queues that no
-- request refers to and that were not used for PRUNE_IDLE_QUEUES_AFTER, with their lanes
-- (worker/prune-repository.ts). A model's next request creates them again. Retention, deleting
-- old requests, is what frees the queues of models no longer asked for.

alter table gateway.queues add column used_at timestamptz not null default now();
comment on column gateway.queues.used_at is
  'When an API process last looked the queue up to route a request to it (each does again at least every sixth of '
  'PRUNE_IDLE_QUEUES_AFTER while it routes there). A queue that no request refers to, unused for PRUNE_IDLE_QUEUES_AFTER, '
  'is deleted with its lanes.';
comment on table gateway.queues is
  'One row per model (and mode) that requests were accepted for (test mode: one queue, "*"). Its requests wait in it '
  'for a lane of one of the model''s deployments. Deleted, with its lanes, once no request refers to it and it has not been '
  'used for PRUNE_IDLE_QUEUES_AFTER; created again by the model''s next request.';
comment on table gateway.lanes is
  'One row per upstream and model: a deployment of a queue''s model (test mode: one lane, the simulator), with its limits, '
  'allowances, pause and health; the queue''s requests start on it, projects taking turns. Deleted with its queue.';

-- Deleting a queue or a lane checks that no request refers to it (on delete restrict): an index
-- probe each, instead of a scan of the requests. Built here, they hold writes to the requests for
-- as long as the build takes; on a large table, build them beforehand with `create index
-- concurrently` under these names, and this finds them.
create index if not exists requests_queue on gateway.requests (queue_id);
create index if not exists requests_lane on gateway.requests (lane_id);
