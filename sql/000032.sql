-- 000032: gateway.claim_queue says which lanes it opened again because their probe ended without
-- a word.
--
-- A probe whose request no longer runs on its lane (cancelled, failed for its deadline, or its
-- worker lost) ends with no outcome of its call to record, and the claim that finds it so sets
-- the lane from probing back to open, due for its next probe now. Every other change of health is
-- logged by the process that makes it and counted in gateway_lane_health_changes_total; this one
-- was neither: the claim returned nothing of it, and the log went from one probe's start to the
-- next's. The claim's last row (request_id null) now carries lane_changes: a JSON array of the
-- lanes it opened so, each with its id and last error, for the worker to report; null when none.
--
-- It also locks the lanes of the model that its worker's configuration no longer lists, before it
-- takes their deployment, with its own in the order of their ids: it took the deployment first,
-- locking those lanes out of that order, and a recording of attempts' ends on them and on its
-- own, which locks them by id, could wait for it in a circle (a deadlock, one of the two failed).
--
-- The return type changes, so the function is made again (drop, create, comment). Workers of the
-- previous version name the columns they read, and go on calling it unchanged. The nine-argument
-- form (000024), for the workers from before 000024, returns what it did: the new function's
-- columns but lane_changes, named rather than `*`.

drop function gateway.claim_queue(bigint, integer, text, bigint[], integer[], integer[], integer[], double precision, double precision, integer);

-- Starts up to max_requests attempts of a queue's requests for worker claim_worker_id: as in
-- sql/000027.sql, with lane_changes on its last row, and every lane it writes locked by id first.

create function gateway.claim_queue(
  claim_queue_id bigint,
  max_requests integer,
  claim_worker_id text,
  lane_ids bigint[],
  limits_max_concurrent integer[],
  limits_requests_per_minute integer[],
  limits_tokens_per_minute integer[],
  pace double precision,
  burst_seconds double precision,
  large_body_bytes integer
) returns table (
  request_id text, attempt integer, charged integer, body text, lane_id bigint, probe boolean, waiting boolean, room_at timestamptz,
  lane_changes json
)
  language plpgsql volatile
  as $$
declare
  lane gateway.lanes;
  lane_index integer;
  now_at timestamptz;
  remaining integer := max_requests;
  -- A deployment took fewer requests than it had room for: the later ones take none, and the
  -- queue is dispatched again at once.
  preferred_has_room boolean := false;
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
  picked_projects bigint[];
  picked_starts bigint[];
  picked_tokens integer[];
  started_ids text[];
  fair_clock bigint;
  -- The lanes whose probe ended without a word, opened again.
  reopened jsonb := '[]';
begin
  -- A dispatch that finds nothing due (another got there first, or the requests that waited
  -- ended) locks no lane, and clears queues.wake_at (written only when set): a request accepted
  -- later has a dispatch of its own, rather than wait for the one scheduled for requests now gone.
  if not exists (
    select from gateway.requests
    where requests.queue_id = claim_queue_id and requests.status in ('queued', 'retrying')
      and requests.next_attempt_at <= clock_timestamp()
  ) then
    update gateway.queues set wake_at = null where id = claim_queue_id and wake_at is not null;
    waiting := false;
    return next;
    return;
  end if;

  -- The lanes are locked in the order of their ids, as the statement recording attempts' ends
  -- locks them, so that the two never wait for each other in a circle: this worker's, and those
  -- of the model that its configuration no longer lists, which take nothing from now on.
  perform from gateway.lanes
  where lanes.id = any(lane_ids)
     or (lanes.queue_id = claim_queue_id and lanes.deployment is not null and lanes.id <> all(lane_ids))
  order by lanes.id
  for update;
  update gateway.lanes set deployment = null
  where lanes.queue_id = claim_queue_id and lanes.deployment is not null and lanes.id <> all(lane_ids);

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
    picked_ids := null;
    started_ids := '{}';
    fair_clock := null;

    -- A probe whose request is no longer running here (its worker died, it was cancelled, its
    -- deadline passed) ended without a word: the next probe is due now.
    if lane.health = 'probing' and not exists (
      select from gateway.requests
      where requests.id = lane.probe_request_id and requests.status = 'processing' and requests.lane_id = lane.id
    ) then
      lane.health := 'open';
      lane.probe_request_id := null;
      lane.probe_at := now_at;
      reopened := reopened || jsonb_build_object('lane_id', lane.id::text, 'last_error', lane.last_error);
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
    if preferred_has_room then allowed := 0; end if;
    if allowed > 0 and limits_max_concurrent[lane_index] is not null then
      select count(*) into running
      from (select from gateway.requests
            where requests.lane_id = lane.id and requests.status = 'processing'
            limit limits_max_concurrent[lane_index]) as in_flight;
      allowed := least(allowed, limits_max_concurrent[lane_index] - running);
    end if;

    if allowed > 0 and limits_tokens_per_minute[lane_index] is null then
      -- The projects with requests due, found one index probe each (which passes over a project's
      -- requests that are not due yet); each then contributes its oldest due requests, and the
      -- turns go round the projects, starting after the lane's last one.
      select array_agg(picked.id order by picked.position), (array_agg(picked.project_id order by picked.position desc))[1]
      into picked_ids, last_project
      from (
        with recursive waiting_projects(project_id) as (
          (select requests.project_id from gateway.requests
           where requests.queue_id = claim_queue_id and requests.status in ('queued', 'retrying') and requests.next_attempt_at <= now_at
           order by requests.project_id limit 1)
          union all
          select (select requests.project_id from gateway.requests
                  where requests.queue_id = claim_queue_id and requests.status in ('queued', 'retrying')
                    and requests.project_id > waiting_projects.project_id and requests.next_attempt_at <= now_at
                  order by requests.project_id limit 1)
          from waiting_projects where waiting_projects.project_id is not null
        ), rotation as (
          select waiting_projects.project_id,
                 row_number() over (order by waiting_projects.project_id <= coalesce(lane.last_project_id, -1),
                                             waiting_projects.project_id) as place,
                 count(*) over () as projects
          from waiting_projects where waiting_projects.project_id is not null
        ), candidates as (
          select due.id, due.project_id, rotation.place,
                 row_number() over (partition by rotation.project_id order by due.next_attempt_at, due.id) as turn
          from rotation
          cross join lateral (
            select requests.id, requests.project_id, requests.next_attempt_at
            from gateway.requests
            where requests.queue_id = claim_queue_id and requests.project_id = rotation.project_id
              and requests.status in ('queued', 'retrying') and requests.next_attempt_at <= now_at
            order by requests.next_attempt_at, requests.id
            -- An equal share of the allowance each; a project with fewer leaves its share to the
            -- next dispatch.
            limit ceil(allowed::numeric / rotation.projects)::integer
          ) as due
        ), ordered as (
          select candidates.*, row_number() over (order by candidates.turn, candidates.place) as position
          from candidates
        )
        select ordered.id, ordered.project_id, ordered.position
        from ordered
        where ordered.position <= allowed
      ) as picked;
    elsif allowed > 0 then
      -- Start-time fair queueing: each project's due requests, oldest first, start where its last
      -- one ended on the lane's clock (or at the clock, if that is further on), one after another,
      -- each its tokens long; the lane takes them in the order of their starts, the smaller
      -- request first at an equal start. A call may start while tokens are left: the last one
      -- may overdraw the allowance, by at most a minute of tokens_per_minute.
      select array_agg(picked.id order by picked.position), array_agg(picked.project_id order by picked.position),
             array_agg(picked.start order by picked.position), array_agg(picked.tokens order by picked.position)
      into picked_ids, picked_projects, picked_starts, picked_tokens
      from (
        with recursive waiting_projects(project_id) as (
          (select requests.project_id from gateway.requests
           where requests.queue_id = claim_queue_id and requests.status in ('queued', 'retrying') and requests.next_attempt_at <= now_at
           order by requests.project_id limit 1)
          union all
          select (select requests.project_id from gateway.requests
                  where requests.queue_id = claim_queue_id and requests.status in ('queued', 'retrying')
                    and requests.project_id > waiting_projects.project_id and requests.next_attempt_at <= now_at
                  order by requests.project_id limit 1)
          from waiting_projects where waiting_projects.project_id is not null
        ), shares as (
          select waiting_projects.project_id,
                 greatest(lane.fair_share_clock, (
                   select fair_shares.next_start from gateway.lane_fair_shares as fair_shares
                   where fair_shares.lane_id = lane.id and fair_shares.project_id = waiting_projects.project_id
                 )) as next_start,
                 count(*) over () as projects
          from waiting_projects where waiting_projects.project_id is not null
        ), candidates as (
          select due.id, due.project_id, due.tokens, due.turn,
                 shares.next_start + sum(due.tokens) over (partition by due.project_id order by due.turn) - due.tokens as start
          from shares
          cross join lateral (
            select requests.id, requests.project_id,
                   least(coalesce(requests.prompt_tokens_estimate, coalesce(requests.body_bytes, octet_length(requests.body::text)) / 4),
                         limits_tokens_per_minute[lane_index]) as tokens,
                   row_number() over (order by requests.next_attempt_at, requests.id) as turn
            from gateway.requests
            where requests.queue_id = claim_queue_id and requests.project_id = shares.project_id
              and requests.status in ('queued', 'retrying') and requests.next_attempt_at <= now_at
            order by requests.next_attempt_at, requests.id
            -- At most an equal share of the allowance each, so that a claim reads few rows however
            -- many projects wait; a project with more takes the rest at the next dispatch, still
            -- in the order of the starts, which its clock keeps.
            limit ceil(allowed::numeric / shares.projects)::integer
          ) as due
        ), ordered as (
          select candidates.*,
                 row_number() over (order by candidates.start, candidates.tokens, candidates.project_id, candidates.turn) as position,
                 sum(candidates.tokens) over (order by candidates.start, candidates.tokens, candidates.project_id, candidates.turn
                                              rows unbounded preceding) as spent
          from candidates
        )
        select ordered.id, ordered.project_id, ordered.start, ordered.tokens, ordered.position
        from ordered
        where ordered.position <= allowed and ordered.spent - ordered.tokens < token_level
      ) as picked;
    end if;

    if picked_ids is not null then
      -- By id, so that the rows are found through the primary key however long the queue.
      for started in
        with updated as (
          update gateway.requests
          set status = 'processing', attempts = requests.attempts + 1, next_attempt_at = null, updated_at = now(),
              lane_id = lane.id
          where requests.id = any(picked_ids) and requests.status in ('queued', 'retrying')
          returning requests.id, requests.attempts, requests.charged_attempts,
                    case when large_body_bytes is null or coalesce(requests.body_bytes, pg_column_size(requests.body)) <= large_body_bytes
                         then requests.body::text end as body,
                    case when limits_tokens_per_minute[lane_index] is null then 0
                         else least(coalesce(requests.prompt_tokens_estimate, coalesce(requests.body_bytes, octet_length(requests.body::text)) / 4),
                                    limits_tokens_per_minute[lane_index]) end as tokens
        ), recorded as (
          insert into gateway.request_attempts (request_id, attempt_number, worker_id, upstream)
          select updated.id, updated.attempts, claim_worker_id, lane.upstream from updated
        )
        select updated.id, updated.attempts, updated.charged_attempts, updated.body, updated.tokens from updated
      loop
        claimed := claimed + 1;
        tokens_claimed := tokens_claimed + started.tokens;
        if limits_tokens_per_minute[lane_index] is not null then started_ids := started_ids || started.id; end if;
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
      -- It had room for more than it found due (its pick saw what had committed before it): a
      -- request committed since then waits for this lane's next claim, and does not go to a
      -- later deployment while this one has room.
      if claimed < allowed and (token_level is null or token_level > tokens_claimed) then
        preferred_has_room := true;
      end if;
    end if;

    if claimed > 0 and limits_tokens_per_minute[lane_index] is not null then
      -- The clock moves to the start of the last request started. Projects at or behind it lose
      -- their rows (they start at the clock), as do those idle for a minute; the projects that
      -- started requests are where their last one ended.
      select greatest(lane.fair_share_clock, max(picked.start)) into fair_clock
      from unnest(picked_ids, picked_starts) as picked(id, start)
      where picked.id = any(started_ids);
      delete from gateway.lane_fair_shares as fair_shares
      where fair_shares.lane_id = lane.id
        and (fair_shares.next_start <= fair_clock
             or (fair_shares.started_at < now_at - interval '1 minute'
                 and not exists (
                   select from gateway.requests
                   where requests.queue_id = claim_queue_id and requests.project_id = fair_shares.project_id
                     and requests.status in ('queued', 'retrying'))));
      insert into gateway.lane_fair_shares (lane_id, project_id, next_start, started_at)
      select lane.id, picked.project_id, max(picked.start + picked.tokens), now_at
      from unnest(picked_ids, picked_projects, picked_starts, picked_tokens) as picked(id, project_id, start, tokens)
      where picked.id = any(started_ids)
      group by picked.project_id
      having max(picked.start + picked.tokens) > fair_clock
      on conflict on constraint lane_fair_shares_pkey
        do update set next_start = excluded.next_start, started_at = excluded.started_at;
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
        fair_share_clock = coalesce(fair_clock, lane.fair_share_clock),
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
  -- A claim that used all of max_requests leaves the rest to the next, as does a lane that started
  -- fewer than it had room for (each project's share of a claim is capped): the next dispatch is
  -- now (null), whatever the later lanes wait for.
  if not still_waiting or remaining <= 0 or preferred_has_room then next_room := null; end if;
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
  lane_changes := case when jsonb_array_length(reopened) > 0 then reopened::json end;
  return next;
end;
$$;
comment on function gateway.claim_queue(bigint, integer, text, bigint[], integer[], integer[], integer[], double precision, double precision, integer) is
  'Starts up to max_requests attempts of a queue on its deployments'' lanes, in the order given, each within its health and '
  'limits (given by the worker from its configuration, with the pace and burst it runs them at, and kept in the lane rows), in its projects'' turns (on a lane with '
  'tokens_per_minute, in their shares of its tokens); returns them, then a row (request_id null) saying whether requests '
  'are still waiting, when a lane has room again, and which lanes it opened again because their probe ended without a word '
  '(lane_changes: lane_id and last_error each, or null). The body of a request of more than large_body_bytes (when given) is returned as null: the worker reads it apart.';

-- The previous form: every body returned, and no lane_changes.
create or replace function gateway.claim_queue(
  claim_queue_id bigint,
  max_requests integer,
  claim_worker_id text,
  lane_ids bigint[],
  limits_max_concurrent integer[],
  limits_requests_per_minute integer[],
  limits_tokens_per_minute integer[],
  pace double precision,
  burst_seconds double precision
) returns table (
  request_id text, attempt integer, charged integer, body text, lane_id bigint, probe boolean, waiting boolean, room_at timestamptz
)
  language sql volatile
  as $$
  select request_id, attempt, charged, body, lane_id, probe, waiting, room_at
  from gateway.claim_queue(claim_queue_id, max_requests, claim_worker_id, lane_ids, limits_max_concurrent,
                           limits_requests_per_minute, limits_tokens_per_minute, pace, burst_seconds, null::integer)
$$;
