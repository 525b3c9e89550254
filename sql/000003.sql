-- 000003: worker pools and their heartbeats, so that the jobs of a pool that died are released
-- within seconds instead of graphile-worker's four hours.

create table gateway.worker_pools (
  id text collate "C" primary key,
  hostname text not null,
  pid integer not null,
  started_at timestamptz not null default now(),
  last_seen_at timestamptz not null default now()
);
comment on table gateway.worker_pools is
  'Live graphile-worker pools, one row per worker process (its pool id is what graphile-worker writes in jobs.locked_by). '
  'A pool not seen for WORKER_DEAD_AFTER_MS is presumed dead: any live worker deletes its row and force-unlocks its jobs.';
comment on column gateway.worker_pools.id is 'The graphile-worker pool id, as in graphile_worker.jobs.locked_by.';
comment on column gateway.worker_pools.last_seen_at is 'Refreshed by the pool''s heartbeat, several times per WORKER_DEAD_AFTER_MS.';
