-- 000012: provider outages and deployments.
--
-- Queues: the requests of one model (and mode) wait in its queue; the model's deployments, one
-- lane per upstream that serves it, take them in the configuration's order: the first that is
-- healthy and has room under its limits. Limits, pauses, fair share and health stay per lane.
--
-- Lane health: a lane whose calls fail for the upstream's reasons opens. While it is open, no
-- call starts on it but one probe at a time, at growing intervals; a call that succeeds closes it.
-- Failures while the lane fails as a whole are not charged to the request (charged_attempts),
-- so requests wait out an outage instead of failing.

create table gateway.queues (
  id bigint generated always as identity primary key,
  mode text not null constraint queues_mode check (mode in ('live', 'test')),
  model text not null,
  wake_at timestamptz,
  created_at timestamptz not null default now(),
  constraint queues_unique unique (mode, model)
);
comment on table gateway.queues is
  'One row per model (and mode) that requests were accepted for (test mode: one queue, "*"). Its requests wait in it '
  'for a lane of one of the model''s deployments.';
comment on column gateway.queues.id is 'Identity of the queue (requests.queue_id; dispatch_queue jobs name it).';
comment on column gateway.queues.mode is 'live or test: the modes never share a queue.';
comment on column gateway.queues.model is 'The model as clients request it ("*" for test mode''s one queue).';
comment on column gateway.queues.wake_at is
  'A dispatch of the queue is scheduled for then (its lanes wait for limits, a pause or a probe); new requests need not wake it sooner.';
comment on column gateway.queues.created_at is 'When the first request for this model was accepted.';

insert into gateway.queues (mode, model)
select distinct mode, model from gateway.lanes
on conflict do nothing;

alter table gateway.lanes
  add column queue_id bigint constraint lanes_queue_id_fkey references gateway.queues (id) on delete cascade,
  add column deployment integer constraint lanes_deployment check (deployment >= 1),
  add column health text not null default 'healthy' constraint lanes_health check (health in ('healthy', 'open', 'probing')),
  add column health_since timestamptz,
  add column failure_streak integer not null default 0 constraint lanes_failure_streak check (failure_streak >= 0),
  add column last_failed_request_id text collate "C",
  add column window_started_at timestamptz,
  add column window_calls integer not null default 0 constraint lanes_window_calls check (window_calls >= 0),
  add column window_failures integer not null default 0 constraint lanes_window_failures check (window_failures >= 0),
  add column probe_interval_ms integer constraint lanes_probe_interval_ms check (probe_interval_ms >= 0),
  add column probe_at timestamptz,
  add column probe_request_id text collate "C",
  add column last_error text,
  add column last_error_at timestamptz,
  add constraint lanes_probe_when_probing check ((health = 'probing') = (probe_request_id is not null)),
  add constraint lanes_probe_at_when_open check ((health = 'open') = (probe_at is not null));
update gateway.lanes set queue_id = queues.id, deployment = 1
from gateway.queues
where queues.mode = lanes.mode and queues.model = lanes.model;
alter table gateway.lanes alter column queue_id set not null;
create index lanes_queue on gateway.lanes (queue_id);

comment on column gateway.lanes.queue_id is 'The queue of the lane''s model: the requests it takes.';
comment on column gateway.lanes.deployment is
  'The lane''s place among its model''s deployments (1: preferred), as the last worker that dispatched the model listed it; '
  'null: that worker''s UPSTREAMS_FILE no longer lists this upstream for the model, and the lane takes nothing.';
comment on column gateway.lanes.health is
  'healthy: calls start under its limits; open: its calls failed for the upstream''s reasons, and only a probe starts, at probe_at; '
  'probing: a probe call is under way (probe_request_id). A call that succeeds makes it healthy.';
comment on column gateway.lanes.health_since is
  'When the lane last opened or closed (open and probing alternate within an outage); null: healthy since it was created.';
comment on column gateway.lanes.failure_streak is
  'Calls in a row, of different requests, that failed for the upstream''s reasons (a success resets it); five open the lane.';
comment on column gateway.lanes.last_failed_request_id is
  'The request of the last such failure: another failure of the same request does not add to the streak (it may be the request''s own fault).';
comment on column gateway.lanes.window_started_at is
  'Start of the current minute of counting (begun by a failure): when most of its calls failed, ten at least, the lane opens.';
comment on column gateway.lanes.window_calls is 'Calls ended in the current window, successes and upstream failures.';
comment on column gateway.lanes.window_failures is 'Calls failed for the upstream''s reasons in the current window.';
comment on column gateway.lanes.probe_interval_ms is 'While open: the wait before the next probe, doubled after each failed probe up to a ceiling.';
comment on column gateway.lanes.probe_at is 'While open: when the next probe may start.';
comment on column gateway.lanes.probe_request_id is 'While probing: the request whose attempt is the probe.';
comment on column gateway.lanes.last_error is 'The last upstream failure the lane saw: its code and what happened (the gateway''s words).';
comment on column gateway.lanes.last_error_at is 'When that failure was recorded.';

-- Requests wait in their model's queue; lane_id is now the lane of their latest attempt.
alter table gateway.requests
  add column queue_id bigint constraint requests_queue_id_fkey references gateway.queues (id) on delete restrict,
  add column charged_attempts integer not null default 0
    constraint requests_charged_attempts check (charged_attempts >= 0 and charged_attempts <= attempts);
-- (Only where requests wait: an update of requests fires their statement triggers, which need
-- graphile-worker's schema, not there yet in a new database.)
do $$
begin
  if exists (select from gateway.requests where finished_at is null) then
    update gateway.requests
    set queue_id = lanes.queue_id, charged_attempts = requests.attempts
    from gateway.lanes
    where requests.finished_at is null and lanes.id = requests.lane_id;
  end if;
end;
$$;
comment on column gateway.requests.queue_id is 'The queue (model and mode) the request waits in until a lane takes it.';
comment on column gateway.requests.lane_id is
  'The lane (upstream and model) of the request''s latest attempt; the lane that completed it, once completed.';
comment on column gateway.requests.charged_attempts is
  'Attempts charged to the request toward MAX_ATTEMPTS: those that failed for its own reasons, or while its lane was otherwise '
  'healthy. Failures during an outage, and 429s, are not charged (attempts counts every attempt).';

-- The requests a queue can start, project by project, in order (a claim reads them so).
create index requests_waiting on gateway.requests (queue_id, project_id, next_attempt_at, id)
  where status in ('queued', 'retrying');
drop index gateway.requests_ready;

alter table gateway.request_attempts
  add column upstream text,
  add column charged boolean;
comment on column gateway.request_attempts.upstream is 'The upstream that ran the attempt ("simulator" in test mode).';
comment on column gateway.request_attempts.charged is
  'Whether the attempt counted toward MAX_ATTEMPTS (null while running, or when it succeeded).';

create or replace view gateway.attempt_history as
  select attempts.request_id, attempts.attempt_number, attempts.outcome, attempts.error_code,
         attempts.upstream_status, attempts.duration_ms, attempts.started_at, attempts.finished_at,
         attempts.worker_id, attempts.error_detail, requests.status as request_status,
         attempts.upstream, attempts.charged
  from gateway.request_attempts as attempts
  join gateway.requests on requests.id = attempts.request_id;
comment on column gateway.attempt_history.upstream is 'The upstream that ran the attempt.';
comment on column gateway.attempt_history.charged is 'Whether the attempt counted toward MAX_ATTEMPTS.';

create or replace view gateway.lane_states as
  select lanes.id, lanes.mode, lanes.upstream, lanes.model,
         (select count(*) from gateway.requests
          where requests.queue_id = lanes.queue_id and requests.status in ('queued', 'retrying')) as waiting,
         (select count(*) from gateway.requests
          where requests.lane_id = lanes.id and requests.status = 'processing') as running,
         lanes.max_concurrent, lanes.requests_per_minute, lanes.tokens_per_minute,
         case when lanes.paused_until > now() then lanes.paused_until end as paused_until,
         case when queues.wake_at > now() then queues.wake_at end as next_dispatch_at,
         case when lanes.deployment is null then 'unlisted' else lanes.health end as health,
         lanes.health_since, lanes.last_error, lanes.last_error_at,
         case when lanes.health = 'open' then lanes.probe_at end as next_probe_at,
         lanes.deployment
  from gateway.lanes
  join gateway.queues on queues.id = lanes.queue_id
  union all
  -- A model with requests waiting and no lane that a worker lists: they wait until an upstream
  -- serves it again, or their deadline.
  select null, queues.mode, null, queues.model,
         (select count(*) from gateway.requests
          where requests.queue_id = queues.id and requests.status in ('queued', 'retrying')),
         0, null, null, null, null,
         case when queues.wake_at > now() then queues.wake_at end,
         'no_upstream', null, null, null, null, null
  from gateway.queues
  where not exists (select from gateway.lanes where lanes.queue_id = queues.id and lanes.deployment is not null)
    and exists (select from gateway.requests
                where requests.queue_id = queues.id and requests.status in ('queued', 'retrying'));
comment on view gateway.lane_states is
  'Each lane: the requests waiting for it (those of its model''s queue, shared by the model''s deployments) and in flight, '
  'its limits, whether it is paused, and its health; and each model whose requests wait with no upstream to serve them.';
comment on column gateway.lane_states.waiting is 'Requests queued or retrying for the lane''s model (due or not), shared by its deployments.';
comment on column gateway.lane_states.next_dispatch_at is 'Set while the model''s lanes wait for limits, a pause or a probe: when it is next dispatched.';
comment on column gateway.lane_states.health is
  'healthy, open (failing: only probes start), probing (a probe is under way), unlisted (no worker''s configuration lists it '
  'for the model any more), or no_upstream (a model with requests waiting and no lane to take them).';
comment on column gateway.lane_states.health_since is 'When the lane last opened or closed.';
comment on column gateway.lane_states.last_error is 'The last upstream failure the lane saw: why it is open, when it is.';
comment on column gateway.lane_states.last_error_at is 'When that failure was recorded.';
comment on column gateway.lane_states.next_probe_at is 'While open: when the next probe may start.';
comment on column gateway.lane_states.deployment is 'The lane''s place among its model''s deployments (1: preferred).';

alter table gateway.lanes drop column wake_at;
drop function gateway.claim_lane(bigint, integer, text, integer, integer, integer);

-- Starts up to max_requests attempts of a queue's requests for worker claim_worker_id, on its
-- deployments' lanes in the order given (the worker's configuration, with each lane's limits):
-- each lane takes what its health and limits allow, in its projects' turns, and the next takes
-- the rest. An open lane takes one request as its probe when the probe is due. Returns one row
-- per attempt started (probe: it is its lane's probe), then one summary row (request_id null):
-- whether requests that are due are still waiting, and when a lane has room again if only time
-- makes it (null: a lane has room now, or only finishing calls make room).
-- PL/pgSQL so that it is one round trip whose statements each see what committed before them:
-- each lane row is locked before its calls in flight are counted and its turn is taken.
create function gateway.claim_queue(
  claim_queue_id bigint,
  max_requests integer,
  claim_worker_id text,
  lane_ids bigint[],
  limits_max_concurrent integer[],
  limits_requests_per_minute integer[],
  limits_tokens_per_minute integer[]
) returns table (
  request_id text, attempt integer, charged integer, body text, lane_id bigint, probe boolean, waiting boolean, room_at timestamptz
)
  language plpgsql volatile
  as $$
declare
  -- A call reaches the upstream a moment after it is admitted, and not always in the order
  -- admitted, so a lane paced exactly at its limits would meet a 429 now and then. It is paced
  -- at 95 % of them, and starts at most 0.9 s worth of its requests_per_minute at once: a call
  -- may then arrive about 100 ms late against the one after it and still find room.
  pace constant double precision := 0.95;
  burst_seconds constant double precision := 0.9;
  lane gateway.lanes;
  lane_index integer;
  now_at timestamptz;
  remaining integer := max_requests;
  elapsed double precision;
  allowed integer;
  request_rate double precision;
  request_level double precision;
  token_rate double precision;
  token_level double precision;
  running integer;
  claimed integer;
  tokens_claimed bigint;
  last_project bigint;
  is_probe boolean;
  lane_room timestamptz;
  next_room timestamptz;
  still_waiting boolean;
  started record;
  picked_ids text[];
begin
  -- A dispatch that finds nothing due (another got there first) neither locks nor writes.
  if not exists (
    select from gateway.requests
    where requests.queue_id = claim_queue_id and requests.status in ('queued', 'retrying')
      and requests.next_attempt_at <= clock_timestamp()
  ) then
    waiting := false;
    return next;
    return;
  end if;

  -- Lanes of the model that this worker's configuration no longer lists take nothing.
  update gateway.lanes set deployment = null
  where lanes.queue_id = claim_queue_id and lanes.deployment is not null and lanes.id <> all(lane_ids);
  -- The lanes are locked in the order of their ids, as the statement recording attempts' ends
  -- locks them, so that the two never wait for each other in a circle.
  perform from gateway.lanes where lanes.id = any(lane_ids) order by lanes.id for update;

  now_at := clock_timestamp();
  for lane_index in 1 .. coalesce(array_length(lane_ids, 1), 0) loop
    exit when remaining <= 0;
    select * into lane from gateway.lanes where id = lane_ids[lane_index] for update;
    if not found then
      raise exception 'lane % does not exist', lane_ids[lane_index] using errcode = 'no_data_found';
    end if;
    elapsed := greatest(0, extract(epoch from now_at - coalesce(lane.refilled_at, now_at)));
    allowed := remaining;
    claimed := 0;
    tokens_claimed := 0;
    last_project := null;
    lane_room := null;
    is_probe := false;
    request_level := null;
    token_level := null;

    -- A probe whose request is no longer running here (its worker died, it was cancelled, its
    -- deadline passed) ended without a word: the next probe is due now.
    if lane.health = 'probing' and not exists (
      select from gateway.requests
      where requests.id = lane.probe_request_id and requests.status = 'processing' and requests.lane_id = lane.id
    ) then
      lane.health := 'open';
      lane.probe_request_id := null;
      lane.probe_at := now_at;
    end if;
    if lane.health = 'probing' then
      allowed := 0;
    elsif lane.health = 'open' then
      if lane.probe_at <= now_at then
        allowed := 1;
        is_probe := true;
      else
        allowed := 0;
        lane_room := lane.probe_at;
      end if;
    end if;

    if limits_requests_per_minute[lane_index] is not null then
      request_rate := pace * limits_requests_per_minute[lane_index] / 60.0;
      -- (a lane without an allowance yet starts with a full one)
      request_level := least(greatest(1, burst_seconds * limits_requests_per_minute[lane_index] / 60.0),
                             coalesce(lane.request_allowance + request_rate * elapsed, 'infinity'));
      allowed := least(allowed, floor(request_level)::integer);
    end if;
    if limits_tokens_per_minute[lane_index] is not null then
      token_rate := pace * limits_tokens_per_minute[lane_index] / 60.0;
      token_level := least(burst_seconds * limits_tokens_per_minute[lane_index] / 60.0,
                           coalesce(lane.token_allowance + token_rate * elapsed, 'infinity'));
      if token_level <= 0 then allowed := 0; end if;
    end if;
    if lane.paused_until > now_at then allowed := 0; end if;
    if allowed > 0 and limits_max_concurrent[lane_index] is not null then
      select count(*) into running
      from (select from gateway.requests
            where requests.lane_id = lane.id and requests.status = 'processing'
            limit limits_max_concurrent[lane_index]) as in_flight;
      allowed := least(allowed, limits_max_concurrent[lane_index] - running);
    end if;

    if allowed > 0 then
      -- The projects with requests waiting, found one index probe each; each then contributes its
      -- oldest due requests, and the turns go round the projects, starting after the lane's last one.
      select array_agg(picked.id order by picked.position), (array_agg(picked.project_id order by picked.position desc))[1]
      into picked_ids, last_project
      from (
        with recursive waiting_projects(project_id) as (
          (select requests.project_id from gateway.requests
           where requests.queue_id = claim_queue_id and requests.status in ('queued', 'retrying')
           order by requests.project_id limit 1)
          union all
          select (select requests.project_id from gateway.requests
                  where requests.queue_id = claim_queue_id and requests.status in ('queued', 'retrying')
                    and requests.project_id > waiting_projects.project_id
                  order by requests.project_id limit 1)
          from waiting_projects where waiting_projects.project_id is not null
        ), rotation as (
          select waiting_projects.project_id,
                 row_number() over (order by waiting_projects.project_id <= coalesce(lane.last_project_id, -1),
                                             waiting_projects.project_id) as place,
                 count(*) over () as projects
          from waiting_projects where waiting_projects.project_id is not null
        ), candidates as (
          select due.id, due.project_id, rotation.place, due.estimate,
                 row_number() over (partition by rotation.project_id order by due.next_attempt_at, due.id) as turn
          from rotation
          cross join lateral (
            select requests.id, requests.project_id, requests.next_attempt_at,
                   case when limits_tokens_per_minute[lane_index] is null then 0
                        else coalesce(requests.prompt_tokens_estimate, octet_length(requests.body::text) / 4) end as estimate
            from gateway.requests
            where requests.queue_id = claim_queue_id and requests.project_id = rotation.project_id
              and requests.status in ('queued', 'retrying') and requests.next_attempt_at <= now_at
            order by requests.next_attempt_at, requests.id
            -- An equal share of the allowance each; a project with fewer leaves its share to the
            -- next dispatch.
            limit ceil(allowed::numeric / rotation.projects)::integer
          ) as due
        ), ordered as (
          select candidates.*, row_number() over (order by candidates.turn, candidates.place) as position,
                 sum(candidates.estimate) over (order by candidates.turn, candidates.place rows unbounded preceding) as spent
          from candidates
        )
        select ordered.id, ordered.project_id, ordered.position
        from ordered
        where ordered.position <= allowed
          -- A call may start while tokens are left: the last one may overdraw the allowance.
          and (limits_tokens_per_minute[lane_index] is null or ordered.spent - ordered.estimate < token_level)
      ) as picked;

      -- By id, so that the rows are found through the primary key however long the queue.
      for started in
        with updated as (
          update gateway.requests
          set status = 'processing', attempts = requests.attempts + 1, next_attempt_at = null, updated_at = now(),
              lane_id = lane.id
          where requests.id = any(picked_ids) and requests.status in ('queued', 'retrying')
          returning requests.id, requests.attempts, requests.charged_attempts, requests.body::text as body,
                    case when limits_tokens_per_minute[lane_index] is null then 0
                         else coalesce(requests.prompt_tokens_estimate, octet_length(requests.body::text) / 4) end as estimate
        ), recorded as (
          insert into gateway.request_attempts (request_id, attempt_number, worker_id, upstream)
          select updated.id, updated.attempts, claim_worker_id, lane.upstream from updated
        )
        select updated.id, updated.attempts, updated.charged_attempts, updated.body, updated.estimate from updated
      loop
        claimed := claimed + 1;
        tokens_claimed := tokens_claimed + started.estimate;
        if is_probe then
          lane.health := 'probing';
          lane.probe_request_id := started.id;
          lane.probe_at := null;
        end if;
        request_id := started.id;
        attempt := started.attempts;
        charged := started.charged_attempts;
        body := started.body;
        lane_id := lane.id;
        probe := is_probe;
        return next;
      end loop;
      remaining := remaining - claimed;
    end if;

    request_level := request_level - claimed;
    token_level := token_level - tokens_claimed;
    -- When time alone gives this lane room again (finishing calls wake the queue themselves).
    if lane.paused_until > now_at then lane_room := greatest(lane_room, lane.paused_until); end if;
    if request_level < 1 then
      lane_room := greatest(lane_room, now_at + (1 - request_level) / request_rate * interval '1 second');
    end if;
    if token_level <= 0 then
      lane_room := greatest(lane_room, now_at + (0.001 - token_level) / token_rate * interval '1 second');
    end if;
    next_room := least(next_room, lane_room);

    update gateway.lanes
    set max_concurrent = limits_max_concurrent[lane_index],
        requests_per_minute = limits_requests_per_minute[lane_index],
        tokens_per_minute = limits_tokens_per_minute[lane_index],
        request_allowance = request_level,
        token_allowance = token_level,
        refilled_at = now_at,
        last_project_id = coalesce(last_project, lane.last_project_id),
        deployment = lane_index,
        health = lane.health,
        probe_at = lane.probe_at,
        probe_request_id = lane.probe_request_id
    where id = lane.id;
  end loop;

  still_waiting := exists (
    select from gateway.requests
    where requests.queue_id = claim_queue_id and requests.status in ('queued', 'retrying') and requests.next_attempt_at <= now_at
  );
  -- A claim that used all of max_requests leaves the rest to the next (null: room now).
  if not still_waiting or remaining <= 0 then next_room := null; end if;
  -- No upstream serves the model in this worker's configuration: look again in a minute, in
  -- case one that does is started meanwhile.
  if still_waiting and coalesce(array_length(lane_ids, 1), 0) = 0 then next_room := now_at + interval '1 minute'; end if;

  update gateway.queues set wake_at = next_room where id = claim_queue_id and wake_at is distinct from next_room;
  -- Requests wait for time to give a lane room: one dispatch at that time (a later one replaces
  -- it). Accepted requests add no dispatch of their own before then (queues.wake_at).
  if next_room is not null then
    perform graphile_worker.add_jobs(array[row(
      'dispatch_queue', json_build_object('queue_id', claim_queue_id), null, next_room, null,
      'dispatch_queue:' || claim_queue_id, null, null
    )::graphile_worker.job_spec]);
  end if;

  request_id := null;
  attempt := null;
  charged := null;
  body := null;
  lane_id := null;
  probe := null;
  waiting := still_waiting;
  room_at := next_room;
  return next;
end;
$$;
comment on function gateway.claim_queue(bigint, integer, text, bigint[], integer[], integer[], integer[]) is
  'Starts up to max_requests attempts of a queue on its deployments'' lanes, in the order given, each within its health and '
  'limits (given by the worker from its configuration, and kept in the lane rows), in its projects'' turns; returns them, then '
  'a row (request_id null) saying whether requests are still waiting and when a lane has room again.';
