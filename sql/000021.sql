-- 000021: gateway.create_pattern_queue, the creation of a queue for a model that only a pattern
-- of the upstreams file serves, in one round trip.
--
-- Such queues are bounded (MAX_PATTERN_MODELS per mode), and creations take their turns behind an
-- advisory lock so that the bound holds across API processes. Held by a transaction of several
-- statements, the lock lasted the round trips between them, and a flood of invented model names
-- kept API connections idle in a transaction while the others queued for the lock. As one
-- statement, the lock is held only while the server runs it.

-- The queue of (queue_mode, queue_model), its use recorded, created when fewer than max_queues
-- queues of the mode are for models that `named` (the models the configuration lists by name)
-- does not hold: null when it would be one too many. PL/pgSQL so that each statement sees what
-- committed before it, the creations of other processes that held the lock before included.
create function gateway.create_pattern_queue(queue_mode text, queue_model text, max_queues integer, named text[])
  returns bigint
  language plpgsql volatile
  as $$
declare
  found_id bigint;
begin
  -- PATTERN_QUEUES_LOCK of src/lanes/repository.ts.
  perform pg_advisory_xact_lock(7242318002);
  update gateway.queues set used_at = now()
  where mode = queue_mode and model = queue_model
  returning id into found_id;
  if found_id is not null then
    return found_id;
  end if;
  if (select count(*) from (
        select from gateway.queues where mode = queue_mode and model <> all (named) limit max_queues
      ) as unnamed) >= max_queues then
    return null;
  end if;
  insert into gateway.queues (mode, model) values (queue_mode, queue_model)
  on conflict (mode, model) do update set used_at = now()
  returning id into found_id;
  return found_id;
end;
$$;
comment on function gateway.create_pattern_queue(text, text, integer, text[]) is
  'The queue of a model only a pattern serves, created (behind an advisory lock, so that the bound holds across processes) '
  'while fewer than max_queues queues of the mode are for models not in named; null when it would be one too many.';
