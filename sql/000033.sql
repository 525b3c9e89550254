-- 000033: a project's place in a lane's fair share follows the tokens its calls used: the finish
-- statement (src/worker/attempts-repository.ts) moves lane_fair_shares.next_start by the
-- correction it makes to the lane's allowance once a call's usage is known, or by the whole
-- estimate given back when an attempt ends without a completion, never behind the lane's clock.

comment on column gateway.lane_fair_shares.next_start is
  'Where on the lane''s fair_share_clock the project''s next request starts: its last request''s start plus its tokens '
  '(the prompt estimate while its call runs, at most tokens_per_minute; then the tokens the call used, none when it ended '
  'without a completion, never behind the clock). Requests start in the order of their starts.';
