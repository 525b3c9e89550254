-- 000025: a lane's probe that ends without an outcome of its call has its queue dispatched.
--
-- A probing lane starts nothing until its probe ends, and the probe's outcome (the statement that
-- records a finished attempt) closes the lane or opens it again, and dispatches its queue. A
-- cancel, or the expiry of a deadline, ends the probe's request and attempt without an outcome:
-- the probe's call is aborted, and what its worker records late finds the attempt ended and
-- teaches the lane nothing. gateway.claim_queue takes a probe whose request no longer runs for
-- ended, and starts the next, but nothing dispatched the queue any more: the lane stayed probing,
-- and every request of its model waited until its deadline (24 h by default) or until a new one
-- was accepted. Both statements now call this function with the requests they ended.

create index lanes_probe_request on gateway.lanes (probe_request_id) where health = 'probing';

-- (PL/pgSQL, whose statements are resolved when first run: in a new database, graphile-worker's
-- schema is made after this migration.)
create function gateway.dispatch_probe_queues(ended_ids text[]) returns integer
  language plpgsql volatile
  as $$
declare
  queue_ids bigint[];
begin
  queue_ids := array(
    select distinct lanes.queue_id
    from gateway.lanes
    where lanes.health = 'probing' and lanes.probe_request_id = any (ended_ids)
    order by lanes.queue_id
  );
  if cardinality(queue_ids) = 0 then
    return 0;
  end if;
  perform graphile_worker.add_jobs(array(
    select row('dispatch_queue', json_build_object('queue_id', queue_id), null, null, null, null, null, null)::graphile_worker.job_spec
    from unnest(queue_ids) as queue_id
  ));
  return cardinality(queue_ids);
end;
$$;
comment on function gateway.dispatch_probe_queues(text[]) is
  'Adds a dispatch of the queue of each probing lane whose probe''s request is among ended_ids (ended by a cancel or a '
  'deadline, without an outcome of its call), so that the queue''s next claim starts the next probe; returns the jobs added.';
