-- 000008: lanes. A lane is one upstream and one model (in test mode, the simulator); its
-- requests wait in it until it has room under its limits, and projects take turns in it. The
-- lane's state lives here, so that its limits hold across every worker process and machine.
-- Also: token usage per request, the per-key intake counters, and the usage_daily view.

create table gateway.lanes (
  id bigint generated always as identity primary key,
  mode text not null constraint lanes_mode check (mode in ('live', 'test')),
  upstream text not null,
  model text not null,
  max_concurrent integer constraint lanes_max_concurrent check (max_concurrent >= 1),
  requests_per_minute integer constraint lanes_requests_per_minute check (requests_per_minute >= 1),
  tokens_per_minute integer constraint lanes_tokens_per_minute check (tokens_per_minute >= 1),
  request_allowance double precision,
  token_allowance double precision,
  refilled_at timestamptz,
  paused_until timestamptz,
  wake_at timestamptz,
  last_project_id bigint,
  created_at timestamptz not null default now(),
  constraint lanes_unique unique (mode, upstream, model)
);
comment on table gateway.lanes is
  'One row per upstream and model that requests were sent to (test mode: one lane, the simulator). '
  'Requests wait in their lane until it has room; within a lane, projects take turns.';
comment on column gateway.lanes.upstream is 'Name of the upstream in UPSTREAMS_FILE ("default" without one; "simulator" in test mode).';
comment on column gateway.lanes.model is 'The model, as requested ("*" for the simulator''s one lane).';
comment on column gateway.lanes.max_concurrent is 'Calls in flight at most, as the last dispatching worker was configured; null: no limit.';
comment on column gateway.lanes.requests_per_minute is 'Calls started per minute at most (paced at 95 %, at most 0.9 s worth at once); null: no limit.';
comment on column gateway.lanes.tokens_per_minute is 'Tokens per minute at most (paced at 95 %): prompt tokens estimated at the start, corrected with usage; null: no limit.';
comment on column gateway.lanes.request_allowance is
  'Calls that may start now under requests_per_minute, as of refilled_at: a bucket of 0.9 s of calls, refilled continuously.';
comment on column gateway.lanes.token_allowance is
  'Tokens that may be spent now under tokens_per_minute, as of refilled_at (below zero after a large request: the lane waits).';
comment on column gateway.lanes.refilled_at is 'When the allowances were last brought up to date.';
comment on column gateway.lanes.paused_until is 'An upstream 429 pauses the lane until then (its retry-after, or the backoff).';
comment on column gateway.lanes.wake_at is 'A dispatch of the lane is scheduled for then (it waits for its limits); new requests need not wake it sooner.';
comment on column gateway.lanes.last_project_id is 'The project that had the last turn: the next dispatch starts with the projects after it.';

-- The lane and its token estimate are set when a request is accepted; the usage when it completes.
-- Requests that were finished before this migration keep a null lane.
alter table gateway.requests
  add column lane_id bigint constraint requests_lane_id_fkey references gateway.lanes (id) on delete restrict,
  add column prompt_tokens_estimate integer,
  add column prompt_tokens integer,
  add column completion_tokens integer,
  add column total_tokens integer;
comment on column gateway.requests.lane_id is 'The lane (upstream and model) the request was routed to when it was accepted.';
comment on column gateway.requests.prompt_tokens_estimate is
  'Prompt tokens estimated from the body when it was accepted, for lanes with tokens_per_minute; null otherwise.';
comment on column gateway.requests.prompt_tokens is 'usage.prompt_tokens of the result, once completed.';
comment on column gateway.requests.completion_tokens is 'usage.completion_tokens of the result, once completed.';
comment on column gateway.requests.total_tokens is 'usage.total_tokens of the result, once completed.';
comment on column gateway.requests.next_attempt_at is
  'While queued or retrying: when the next attempt may start (for a queued request, when it was accepted). '
  'It starts then, or later when its lane has no room.';

-- Requests waiting when this migration runs go to the lanes the gateway would route them to
-- without an UPSTREAMS_FILE.
insert into gateway.lanes (mode, upstream, model)
select distinct mode, case when mode = 'test' then 'simulator' else 'default' end,
       case when mode = 'test' then '*' else model end
from gateway.requests
where finished_at is null
on conflict do nothing;
update gateway.requests
set lane_id = lanes.id, next_attempt_at = coalesce(requests.next_attempt_at, requests.created_at)
from gateway.lanes
where requests.finished_at is null
  and lanes.mode = requests.mode
  and lanes.upstream = case when requests.mode = 'test' then 'simulator' else 'default' end
  and lanes.model = case when requests.mode = 'test' then '*' else requests.model end;

-- The requests a lane can start, project by project, in order (a dispatch reads them so).
create index requests_ready on gateway.requests (lane_id, project_id, next_attempt_at, id)
  where status in ('queued', 'retrying');
-- The calls a lane has in flight (max_concurrent).
create index requests_running on gateway.requests (lane_id) where status = 'processing';
-- A project's unfinished requests (MAX_UNFINISHED_PER_PROJECT).
create index requests_unfinished_by_project on gateway.requests (project_id, mode) where finished_at is null;
-- The attempts a worker has under way, recovered when it is found dead.
create index request_attempts_running on gateway.request_attempts (worker_id) where outcome = 'running';

comment on column gateway.request_attempts.worker_id is
  'The worker process that ran the attempt (gateway.worker_pools.id while it lives).';
comment on table gateway.worker_pools is
  'Live worker processes: each has a row for its graphile-worker pool (whose id graphile-worker writes in jobs.locked_by) '
  'and one for itself, the owner of its attempts (request_attempts.worker_id). A row not seen for WORKER_DEAD_AFTER_MS '
  'is presumed dead: any live worker deletes it, force-unlocks its jobs and records its running attempts as worker_lost.';

-- Requests admitted per API key, counted by each API process, so that RATE_LIMIT_RPS holds
-- across processes. Unlogged: after a crash the counts start again, which errs on the side of
-- admitting.
create unlogged table gateway.intake_counters (
  api_key_id text collate "C" not null references gateway.api_keys (id) on delete cascade,
  kind text not null constraint intake_counters_kind check (kind in ('submit', 'lookup')),
  process_id text collate "C" not null,
  admitted bigint not null constraint intake_counters_admitted check (admitted >= 0),
  updated_at timestamptz not null default now(),
  primary key (api_key_id, kind, process_id)
);
comment on table gateway.intake_counters is
  'Requests each API process has admitted for each key since it started (submissions and lookups apart), '
  'so that every process counts the others'' towards RATE_LIMIT_RPS. Rows of processes gone for a minute are deleted.';
comment on column gateway.intake_counters.process_id is 'The API process (random per start).';
comment on column gateway.intake_counters.admitted is 'How many it has admitted for this key so far.';
comment on column gateway.intake_counters.updated_at is 'When the process last reported.';

create view gateway.lane_states as
  select lanes.id, lanes.mode, lanes.upstream, lanes.model,
         (select count(*) from gateway.requests
          where requests.lane_id = lanes.id and requests.status in ('queued', 'retrying')) as waiting,
         (select count(*) from gateway.requests
          where requests.lane_id = lanes.id and requests.status = 'processing') as running,
         lanes.max_concurrent, lanes.requests_per_minute, lanes.tokens_per_minute,
         case when lanes.paused_until > now() then lanes.paused_until end as paused_until,
         case when lanes.wake_at > now() then lanes.wake_at end as next_dispatch_at
  from gateway.lanes;
comment on view gateway.lane_states is 'Each lane: its requests waiting and in flight, its limits, and whether it is paused.';
comment on column gateway.lane_states.waiting is 'Requests queued or retrying in the lane (due or not).';
comment on column gateway.lane_states.running is 'Requests processing: calls in flight.';
comment on column gateway.lane_states.paused_until is 'Set while an upstream 429 pauses the lane.';
comment on column gateway.lane_states.next_dispatch_at is 'Set while the lane waits for its rate limits or a pause: when it is next dispatched.';

create view gateway.usage_daily as
  select (requests.finished_at at time zone 'UTC')::date as day, projects.name as project, requests.mode,
         coalesce(lanes.upstream, case when requests.mode = 'test' then 'simulator' else 'default' end) as upstream,
         requests.model, count(*) as requests,
         coalesce(sum(requests.prompt_tokens), 0) as prompt_tokens,
         coalesce(sum(requests.completion_tokens), 0) as completion_tokens,
         coalesce(sum(requests.total_tokens), 0) as total_tokens
  from gateway.requests
  join gateway.projects on projects.id = requests.project_id
  left join gateway.lanes on lanes.id = requests.lane_id
  where requests.status = 'completed'
  group by 1, 2, 3, 4, 5;
comment on view gateway.usage_daily is
  'Completed requests and their tokens per day (UTC, by completion), project, mode, upstream and model. A full scan: for reports.';
comment on column gateway.usage_daily.requests is 'Requests completed that day.';
comment on column gateway.usage_daily.total_tokens is 'Sum of usage.total_tokens (requests without usage count none).';

-- Starts up to max_requests attempts of one lane, in the lane's turn order, as far as its
-- limits allow, for worker_id. Returns one row per attempt started, then one summary row
-- (request_id null): whether requests that are due are still waiting, and when the lane has
-- room again if a limit other than max_concurrent holds them (null: it has room now, or only
-- finishing calls make room).
-- PL/pgSQL so that it is one round trip whose statements each see what committed before them:
-- the lane row is locked first, then the calls in flight are counted and the turn is taken.
create function gateway.claim_lane(
  claim_lane_id bigint,
  max_requests integer,
  claim_worker_id text,
  limit_max_concurrent integer,
  limit_requests_per_minute integer,
  limit_tokens_per_minute integer
) returns table (request_id text, attempt integer, body text, waiting boolean, room_at timestamptz)
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
  now_at timestamptz;
  elapsed double precision;
  allowed integer := max_requests;
  request_rate double precision;
  request_level double precision;
  token_rate double precision;
  token_level double precision;
  running integer;
  claimed integer := 0;
  tokens_claimed bigint := 0;
  last_project bigint;
  still_waiting boolean;
  next_room timestamptz;
  started record;
  picked_ids text[];
begin
  -- A dispatch that finds nothing due (another got there first) neither locks nor writes.
  if not exists (
    select from gateway.requests
    where requests.lane_id = claim_lane_id and requests.status in ('queued', 'retrying')
      and requests.next_attempt_at <= clock_timestamp()
  ) then
    waiting := false;
    return next;
    return;
  end if;

  select * into lane from gateway.lanes where id = claim_lane_id for update;
  if not found then
    raise exception 'lane % does not exist', claim_lane_id using errcode = 'no_data_found';
  end if;
  now_at := clock_timestamp();
  elapsed := greatest(0, extract(epoch from now_at - coalesce(lane.refilled_at, now_at)));

  if limit_requests_per_minute is not null then
    request_rate := pace * limit_requests_per_minute / 60.0;
    -- (a lane without an allowance yet starts with a full one)
    request_level := least(greatest(1, burst_seconds * limit_requests_per_minute / 60.0),
                           coalesce(lane.request_allowance + request_rate * elapsed, 'infinity'));
    allowed := least(allowed, floor(request_level)::integer);
  end if;
  if limit_tokens_per_minute is not null then
    token_rate := pace * limit_tokens_per_minute / 60.0;
    token_level := least(burst_seconds * limit_tokens_per_minute / 60.0,
                         coalesce(lane.token_allowance + token_rate * elapsed, 'infinity'));
    if token_level <= 0 then allowed := 0; end if;
  end if;
  if lane.paused_until > now_at then allowed := 0; end if;
  if allowed > 0 and limit_max_concurrent is not null then
    select count(*) into running
    from (select from gateway.requests
          where requests.lane_id = claim_lane_id and requests.status = 'processing'
          limit limit_max_concurrent) as in_flight;
    allowed := least(allowed, limit_max_concurrent - running);
  end if;

  if allowed > 0 then
    -- The projects with requests waiting, found one index probe each; each then contributes its
    -- oldest due requests, and the turns go round the projects, starting after the last one.
    select array_agg(picked.id order by picked.position), (array_agg(picked.project_id order by picked.position desc))[1]
    into picked_ids, last_project
    from (
      with recursive waiting_projects(project_id) as (
        (select requests.project_id from gateway.requests
         where requests.lane_id = claim_lane_id and requests.status in ('queued', 'retrying')
         order by requests.project_id limit 1)
        union all
        select (select requests.project_id from gateway.requests
                where requests.lane_id = claim_lane_id and requests.status in ('queued', 'retrying')
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
                 case when limit_tokens_per_minute is null then 0
                      else coalesce(requests.prompt_tokens_estimate, octet_length(requests.body::text) / 4) end as estimate
          from gateway.requests
          where requests.lane_id = claim_lane_id and requests.project_id = rotation.project_id
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
      ), picked as (
        select ordered.id, ordered.project_id, ordered.estimate, ordered.position
        from ordered
        where ordered.position <= allowed
          -- A call may start while tokens are left: the last one may overdraw the allowance.
          and (limit_tokens_per_minute is null or ordered.spent - ordered.estimate < token_level)
      )
      select * from picked
    ) as picked;

    -- By id, so that the rows are found through the primary key however long the lane's queue.
    for started in
      with updated as (
        update gateway.requests
        set status = 'processing', attempts = requests.attempts + 1, next_attempt_at = null, updated_at = now()
        where requests.id = any(picked_ids) and requests.status in ('queued', 'retrying')
        returning requests.id, requests.attempts, requests.body::text as body,
                  case when limit_tokens_per_minute is null then 0
                       else coalesce(requests.prompt_tokens_estimate, octet_length(requests.body::text) / 4) end as estimate
      ), recorded as (
        insert into gateway.request_attempts (request_id, attempt_number, worker_id)
        select updated.id, updated.attempts, claim_worker_id from updated
      )
      select updated.id, updated.attempts, updated.body, updated.estimate from updated
    loop
      claimed := claimed + 1;
      tokens_claimed := tokens_claimed + started.estimate;
      request_id := started.id;
      attempt := started.attempts;
      body := started.body;
      return next;
    end loop;
  end if;

  request_level := request_level - claimed;
  token_level := token_level - tokens_claimed;
  still_waiting := exists (
    select from gateway.requests
    where requests.lane_id = claim_lane_id and requests.status in ('queued', 'retrying') and requests.next_attempt_at <= now_at
  );
  if still_waiting then
    if lane.paused_until > now_at then next_room := lane.paused_until; end if;
    if request_level < 1 then
      next_room := greatest(next_room, now_at + (1 - request_level) / request_rate * interval '1 second');
    end if;
    if token_level <= 0 then
      next_room := greatest(next_room, now_at + (0.001 - token_level) / token_rate * interval '1 second');
    end if;
  end if;

  update gateway.lanes
  set max_concurrent = limit_max_concurrent,
      requests_per_minute = limit_requests_per_minute,
      tokens_per_minute = limit_tokens_per_minute,
      request_allowance = request_level,
      token_allowance = token_level,
      refilled_at = now_at,
      wake_at = next_room,
      last_project_id = coalesce(last_project, lane.last_project_id)
  where id = claim_lane_id;
  -- Requests wait for the lane's limits: one dispatch at the time it has room (a later one
  -- replaces it). Accepted requests add no dispatch of their own before then (wake_at).
  if next_room is not null then
    perform graphile_worker.add_jobs(array[row(
      'dispatch_lane', json_build_object('lane_id', claim_lane_id), null, next_room, null,
      'dispatch_lane:' || claim_lane_id, null, null
    )::graphile_worker.job_spec]);
  end if;

  request_id := null;
  attempt := null;
  body := null;
  waiting := still_waiting;
  room_at := next_room;
  return next;
end;
$$;
comment on function gateway.claim_lane(bigint, integer, text, integer, integer, integer) is
  'Starts up to max_requests attempts of a lane, in its projects'' turns, within its limits (given by the worker from its '
  'configuration, and kept in the lane row); returns them, then a row (request_id null) saying whether requests are still waiting '
  'and when the lane has room again.';
