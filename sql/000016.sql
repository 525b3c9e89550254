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

-- Deleting a queue checks that no request refers to it (requests.queue_id: on delete restrict):
-- an index probe, instead of a scan of the requests. Built here, it holds writes to the requests
-- for as long as the build takes; on a large table, build it beforehand with `create index
-- concurrently` under this name, and this finds it.
create index if not exists requests_queue on gateway.requests (queue_id);

-- A request's lane is one of its queue's (the claim sets it), so the queue's foreign key keeps
-- the lane too: requests.lane_id needs no foreign key of its own, and setting it at each claim
-- costs no check. Only requests finished before queues existed name a lane and no queue; the
-- pruning looks for those through this index, which no later request enters.
alter table gateway.requests drop constraint requests_lane_id_fkey;
create index if not exists requests_lane_before_queues on gateway.requests (lane_id) where queue_id is null;
comment on column gateway.requests.lane_id is
  'The lane (upstream and model) of the request''s latest attempt, one of its queue''s lanes; the lane that completed it, '
  'once completed. Kept by the queue''s foreign key (queue_id): a queue and its lanes are deleted only when no request '
  'refers to the queue.';
