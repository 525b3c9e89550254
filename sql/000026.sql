-- 000026: the comments of gateway.lanes' request limit and allowance say what a lane starts at
-- once without naming a figure. The worker passes it to gateway.claim_queue (burst_seconds), and
-- it is now half a second of requests_per_minute; the comments said 0.9 s, the figure before.

comment on column gateway.lanes.requests_per_minute is
  'Calls started per minute at most (paced at 95 %, at most a part of a second''s worth at once: docs/lanes.md, "Pacing"); null: no limit.';
comment on column gateway.lanes.request_allowance is
  'Calls that may start now under requests_per_minute, as of refilled_at: a bucket of a part of a second of calls, refilled continuously.';
