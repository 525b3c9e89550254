// SQL of the worker's side of requests: recording how attempts ended (they are started by
// gateway.claim_queue, see lanes/repository.ts), and with them what the lanes learn (pauses,
// tokens, health); finding those whose worker died (the supervisor's sweep); and what the
// dispatcher and the runner ask of a request: has it ended, in which queue does it wait, and
// what is its body, when its claim left a large one out.
import { sql, type RawBuilder, type Selectable } from 'kysely';
import type { RequestAttemptsTable, RequestsTable } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import { columnArrays, statement, unnestRows, type InputColumn } from '../db/statement.ts';
import { DISPATCH_QUEUE } from '../lanes/jobs.ts';
import type { LaneHealthRules } from '../lanes/health.ts';
import type { Fault, Usage } from '../upstream/outcome.ts';

export interface AttemptReport {
  upstreamStatus: number | null;
  durationMs: number | null;
}

export interface AttemptFailure extends AttemptReport {
  code: string;
  fault: Fault;
  detail: string;
}

/** How an attempt ended. */
export type Finish =
  /** A success: `laneId` is the lane the attempt ran on. */
  | ({ kind: 'completed'; id: string; attempt: number; laneId: string; result: string; usage: Usage } & AttemptReport)
  /** A failure no retry mends: the request fails. */
  | ({ kind: 'failed'; id: string; attempt: number; pauseMs?: number | undefined } & AttemptFailure)
  /**
   * A failure worth another attempt: the request is retried, unless the attempt is charged to it
   * and its charged attempts reach MAX_ATTEMPTS. A charged retry waits `delayMs`, one not charged
   * `unchargedDelayMs` (its backoff by attempts, as after a 429); but one whose lane is open is
   * due at once: the lane's probes hold it back, and let it go as soon as the lane closes.
   */
  | ({ kind: 'retry'; id: string; attempt: number; delayMs: number; unchargedDelayMs: number; pauseMs?: number | undefined } &
      AttemptFailure);

/**
 * What became of a finish: null when its attempt was no longer the request's running one (nothing
 * changed); with a retry, how long until it is due (from the statement's time).
 */
export type Finished = { status: 'completed' | 'failed' | 'retrying'; charged: boolean | null; retryInMs?: number } | null;

/** A lane whose health a group of finishes changed. */
export interface LaneChange {
  laneId: string;
  upstream: string;
  model: string;
  from: 'healthy' | 'open' | 'probing';
  to: 'healthy' | 'open' | 'probing';
  /** The last upstream failure it saw. */
  lastError: string | null;
}

export interface FinishSettings {
  maxAttempts: number;
  health: LaneHealthRules;
}

/**
 * Records how attempts ended, a group at a time, in one statement: each attempt row, its
 * request (completed with its usage, failed, or retrying with a dispatch of its queue due by the
 * end of the quarter second the retry is), and the lanes they ran on. Each is guarded twice: the attempt must still be
 * running, and the request still processing this very attempt; so a worker presumed dead that
 * comes back late changes nothing.
 *
 * Whose fault a failure is decides whether it is charged toward MAX_ATTEMPTS: the request's own
 * faults, yes; a 429, and a call cut short by its worker's shutdown, never; the provider's (fault
 * 'upstream') only while the lane is otherwise healthy: it is healthy, and most of its calls do not
 * fail. Within a minute of the lane's calls begun by a failure (its window), that is: at most half
 * of the window's calls, with the group's, failed; with no window open, at least as many calls of
 * the group succeeded as failed, or the lane's last call did (no failure since: failure_streak 0),
 * no other call of the group failed, and the lane has not closed after an outage within the minute.
 * So a request that fails where others succeed (poison) is charged each time and ends, while one
 * that fails with nothing succeeding between its attempts is charged once and then waits: the
 * provider may be down with nobody else calling it. A provider failing most calls, some succeeding
 * among them (a brownout: each probe that meets a success closes the lane, and the requests waiting
 * start again together), charges none of them, nor a request retrying alone after such a close: the
 * lane is not otherwise healthy, and a request charged once at each of its reopenings would fail
 * early. In test mode every failure is charged: the simulator fails only as the request asks it to.
 * Groups that record on one live lane at once decide in turn: the statement locks the group's
 * lanes before it reads them, so that two failures at an outage's start, recorded side by side,
 * charge one request, not two.
 *
 * What the lanes learn: a 429 pauses its lane (pauseMs; in live mode only: test mode's one lane
 * is every project's, and its retry waits on its own); a completion corrects the token
 * allowance from the estimate to its usage (one without usage keeps the estimate), and an
 * attempt that ends without a completion gives its estimate back (a call counts at most a
 * minute of its lane's tokens_per_minute either way), and its project's place in the lane's fair
 * share moves by as much; the provider's failures open a lane (a
 * streak of them from different requests, or most of a minute's calls), a probe that fails keeps
 * it open for a longer interval, and a call that succeeds closes it. A lane whose health changes
 * gets a dispatch of its queue, now, and so does one given tokens back while its queue waits for
 * time to give a lane room. Test mode's simulator lane never opens.
 */
export async function finishAttempts(
  db: Db,
  finishes: readonly Finish[],
  settings: FinishSettings,
): Promise<{ finished: Finished[]; laneChanges: LaneChange[] }> {
  const completions = finishes.filter((finish) => finish.kind === 'completed');
  if (completions.length === finishes.length) {
    const finished = await finishCompletions(db, completions, settings.health);
    if (finished) return { finished, laneChanges: [] };
  }
  const rules = settings.health;
  const { rows } = await finishStatement.execute(db, {
    ...columnArrays(FINISH_COLUMNS, finishes),
    max_attempts: settings.maxAttempts,
    window_ms: rules.windowMs,
    open_after_streak: rules.openAfterStreak,
    window_min_failures: rules.windowMinFailures,
    probe_min_ms: rules.probeMinMs,
    probe_max_ms: rules.probeMaxMs,
  });
  return {
    finished: rows.map((row) =>
      row.status === null
        ? null
        : { status: row.status, charged: row.charged, ...(row.retry_in_ms === null ? {} : { retryInMs: row.retry_in_ms }) },
    ),
    laneChanges: (rows[0]?.lane_changes ?? []).map((change) => ({
      laneId: change.lane_id,
      upstream: change.upstream,
      model: change.model,
      from: change.from,
      to: change.to,
      lastError: change.last_error,
    })),
  };
}

interface FinishRow {
  status: 'completed' | 'failed' | 'retrying' | null;
  charged: boolean | null;
  retry_in_ms: number | null;
  lane_changes: { lane_id: string; upstream: string; model: string; from: LaneChange['from']; to: LaneChange['to']; last_error: string | null }[];
}

const failure = (finish: Finish) => (finish.kind === 'completed' ? undefined : finish);
const usage = (finish: Finish) => (finish.kind === 'completed' ? finish.usage : undefined);

/** The finish statement's input columns, each with its type and where a finish has it. */
const FINISH_COLUMNS = [
  ['id', 'text', (f: Finish) => f.id],
  ['attempt', 'int', (f: Finish) => f.attempt],
  ['kind', 'text', (f: Finish) => f.kind],
  ['fault', 'text', (f: Finish) => failure(f)?.fault ?? null],
  ['result', 'text', (f: Finish) => (f.kind === 'completed' ? f.result : null)],
  ['prompt_tokens', 'int', (f: Finish) => usage(f)?.prompt ?? null],
  ['completion_tokens', 'int', (f: Finish) => usage(f)?.completion ?? null],
  ['total_tokens', 'int', (f: Finish) => usage(f)?.total ?? null],
  ['code', 'text', (f: Finish) => failure(f)?.code ?? null],
  ['detail', 'text', (f: Finish) => failure(f)?.detail ?? null],
  ['upstream_status', 'int', (f: Finish) => f.upstreamStatus],
  ['duration_ms', 'int', (f: Finish) => f.durationMs],
  ['delay_ms', 'float8', (f: Finish) => (f.kind === 'retry' ? f.delayMs : null)],
  ['uncharged_delay_ms', 'float8', (f: Finish) => (f.kind === 'retry' ? f.unchargedDelayMs : null)],
  ['pause_ms', 'float8', (f: Finish) => failure(f)?.pauseMs ?? null],
] as const satisfies readonly InputColumn<Finish>[];

/**
 * Whether the row `lanes` of gateway.lanes has its window open: a minute of its calls, begun by a
 * failure, that is not over (what opens a lane by most of a minute's calls failing counts).
 */
const windowOpen = (windowMs: RawBuilder<unknown>) =>
  sql<boolean>`(lanes.window_failures > 0 and lanes.window_started_at > now() - ${windowMs}::int * interval '1 millisecond')`;

const finishStatement = statement(
  [
    ...FINISH_COLUMNS.map(([name]) => name),
    'max_attempts', 'window_ms', 'open_after_streak', 'window_min_failures', 'probe_min_ms', 'probe_max_ms',
  ] as const,
  (v) => sql<FinishRow>`
    with input as (
      ${unnestRows(FINISH_COLUMNS, v)}
    ), lanes_now as (
      -- The group's live lanes, locked in one order (as lane_rows and gateway.claim_queue lock
      -- them) and read as they are now, not as the statement's snapshot saw them: of two groups
      -- recording failures on one lane at once, the second decides whether to charge its own
      -- after the first's are counted, as it would had it begun after it. (Test mode's lane, the
      -- simulator's, learns nothing and charges every failure: it is not locked.)
      select lanes.*
      from gateway.lanes
      where lanes.id in (
        select requests.lane_id
        from input
        join gateway.requests on requests.id = input.id and requests.attempts = input.attempt and requests.status = 'processing'
        where requests.mode = 'live'
      )
      order by lanes.id
      for update
    ), current as (
      -- The requests still running these very attempts, and their lanes as they were before.
      select input.*, requests.mode, requests.charged_attempts, requests.lane_id, requests.project_id,
             coalesce(lanes.health, 'healthy') as health, coalesce(lanes.failure_streak, 0) as failure_streak,
             -- The lane's minute of calls begun by a failure, while it lasts (as lane_next counts it).
             coalesce(${windowOpen(v.window_ms)}, false) as window_open,
             lanes.window_calls, lanes.window_failures,
             -- Healthy for a minute at least: it has not closed after an outage within the minute.
             coalesce(lanes.health_since <= now() - ${v.window_ms}::int * interval '1 millisecond', true) as settled,
             lanes.last_failed_request_id, lanes.probe_request_id,
             -- The provider's failures, in live mode: what a lane's health counts.
             (requests.mode = 'live' and input.fault = 'upstream') as lane_failure,
             -- (estimated as gateway.claim_queue estimates it, and capped as it caps a call's
             -- tokens at a minute of the lane's: sql/000015.sql). A completion without usage (a
             -- provider that leaves it out) keeps what it was charged; an attempt that ends
             -- without a completion (a failure) gives it back.
             case when lanes.tokens_per_minute is null then null
                  when input.kind = 'completed' and input.total_tokens is null then 0
                  else least(coalesce(input.total_tokens, 0), lanes.tokens_per_minute)
                       - least(coalesce(requests.prompt_tokens_estimate, octet_length(requests.body::text) / 4), lanes.tokens_per_minute)
             end as unestimated_tokens
      from input
      join gateway.requests on requests.id = input.id and requests.attempts = input.attempt and requests.status = 'processing'
      left join lanes_now as lanes on lanes.id = requests.lane_id
    ), lane_calls as (
      select lane_id, count(*) filter (where kind = 'completed') as successes, count(*) filter (where lane_failure) as failures
      from current
      group by lane_id
    ), outcomes as (
      select decided.*,
             case when decided.kind <> 'retry' then decided.kind
                  when decided.charged and decided.charged_attempts + 1 >= ${v.max_attempts}::int then 'failed'
                  else 'retrying' end as status
      from (
        select current.*,
               case when current.kind = 'completed' then null
                    -- A call cut short by its worker's shutdown: the operator's restart, in either mode.
                    when current.fault = 'shutdown' then false
                    -- The simulator is never down: test mode's failures are what the client asked for.
                    when current.mode = 'test' then true
                    when current.fault = 'rate_limited' then false
                    when current.lane_failure then
                      current.health = 'healthy'
                      and case when current.window_open
                               then (current.window_failures + lane_calls.failures) * 2
                                    <= current.window_calls + lane_calls.successes + lane_calls.failures
                               else lane_calls.successes >= lane_calls.failures
                                    or (lane_calls.failures = 1 and current.failure_streak = 0 and current.settled) end
                    else true end as charged
        from current
        join lane_calls on lane_calls.lane_id is not distinct from current.lane_id
      ) as decided
    ), attempt_rows as (
      update gateway.request_attempts
      set outcome = case when input.kind = 'completed' then 'succeeded' else 'failed' end,
          finished_at = now(), upstream_status = input.upstream_status, duration_ms = input.duration_ms,
          error_code = input.code, error_detail = input.detail, charged = outcomes.charged
      from input
      left join outcomes on outcomes.ord = input.ord
      where request_attempts.request_id = input.id and request_attempts.attempt_number = input.attempt
        and request_attempts.outcome = 'running'
    ), finished as (
      update gateway.requests
      set status = outcomes.status,
          result = outcomes.result::json,
          result_bytes = octet_length(outcomes.result),
          prompt_tokens = outcomes.prompt_tokens,
          completion_tokens = outcomes.completion_tokens,
          total_tokens = outcomes.total_tokens,
          charged_attempts = requests.charged_attempts + case when outcomes.charged then 1 else 0 end,
          last_error_code = coalesce(outcomes.code, requests.last_error_code),
          finished_at = case when outcomes.status = 'retrying' then null else now() end,
          next_attempt_at = case when outcomes.status = 'retrying'
                                 then now() + case when outcomes.charged then outcomes.delay_ms
                                                   when outcomes.lane_failure and outcomes.health <> 'healthy' then 0
                                                   else outcomes.uncharged_delay_ms end * interval '1 millisecond' end,
          updated_at = now()
      from outcomes
      where requests.id = outcomes.id and requests.attempts = outcomes.attempt and requests.status = 'processing'
      returning requests.id, requests.status, requests.queue_id, requests.next_attempt_at
    ), lane_lessons as (
      select lane_id,
             count(*) filter (where kind = 'completed') as successes,
             count(*) filter (where lane_failure) as failures,
             count(*) filter (where lane_failure and id is distinct from last_failed_request_id) as new_failures,
             max(id) filter (where lane_failure) as failed_request_id,
             coalesce(bool_or(id = probe_request_id), false) as probe_ended,
             coalesce(bool_or(id = probe_request_id and lane_failure), false) as probe_failed,
             max(code || ': ' || detail) filter (where fault in ('upstream', 'rate_limited')) as error,
             -- The simulator's lane is every test project's: a simulated 429 pauses no one else.
             max(pause_ms) filter (where mode = 'live') as pause_ms,
             coalesce(sum(unestimated_tokens), 0) as unestimated_tokens
      -- (only what this statement recorded: an attempt another one recorded first teaches nothing twice)
      from outcomes
      join finished using (id)
      where lane_id is not null
      group by lane_id
    ), lane_rows as (
      -- The lanes with something to learn (a healthy lane's successes change nothing), locked,
      -- in one order, and read again as they are now: two groups finishing on one lane at once
      -- each build on what the other wrote.
      select lanes.*
      from gateway.lanes
      join lane_lessons as lessons on lessons.lane_id = lanes.id
      where lessons.failures > 0 or lessons.pause_ms is not null or lessons.unestimated_tokens <> 0 or lessons.probe_ended
         or (lessons.successes > 0
             and (lanes.health <> 'healthy' or lanes.failure_streak > 0
                  or ${windowOpen(v.window_ms)}))
      order by lanes.id
      for update of lanes
    ), lane_next as (
      select lessons.*, lanes.health as old_health, window_now.*, streak.*, next.*, interval_now.*, probe.*
      from lane_lessons as lessons
      join lane_rows as lanes on lanes.id = lessons.lane_id
      -- A window counts a minute of calls, begun by a failure.
      cross join lateral (
        select ${windowOpen(v.window_ms)} as window_open
      ) as open_window
      cross join lateral (
        select case when open_window.window_open then lanes.window_started_at
                    when lessons.failures > 0 then now() end as window_started_at,
               case when open_window.window_open then lanes.window_calls + lessons.successes + lessons.failures
                    else lessons.failures end as window_calls,
               case when open_window.window_open then lanes.window_failures + lessons.failures
                    else lessons.failures end as window_failures
      ) as window_now
      cross join lateral (
        select case when lessons.successes > 0 then 0 else lanes.failure_streak + lessons.new_failures end as failure_streak
      ) as streak
      cross join lateral (
        select case when lessons.successes > 0 then 'healthy'
                    when lanes.health = 'probing' and lessons.probe_ended then 'open'
                    when lanes.health = 'healthy' and lessons.failures > 0
                         and (streak.failure_streak >= ${v.open_after_streak}::int
                              or (window_now.window_failures >= ${v.window_min_failures}::int
                                  and window_now.window_failures * 2 > window_now.window_calls)) then 'open'
                    else lanes.health end as health
      ) as next
      cross join lateral (
        select case when next.health = 'healthy' then null
                    when lanes.health = 'healthy' then ${v.probe_min_ms}::int
                    when lessons.probe_failed
                      then least(${v.probe_max_ms}::int, coalesce(lanes.probe_interval_ms, ${v.probe_min_ms}::int) * 2)
                    else lanes.probe_interval_ms end as probe_interval_ms
      ) as interval_now
      cross join lateral (
        select case when next.health <> 'open' then null
                    when lanes.health = 'open' then lanes.probe_at
                    -- A probe that ended for its request's own reasons says nothing: the next is due now.
                    when lanes.health = 'probing' and not lessons.probe_failed then now()
                    else now() + interval_now.probe_interval_ms * interval '1 millisecond' end as probe_at,
               case when next.health = 'probing' then lanes.probe_request_id end as probe_request_id
      ) as probe
    ), lanes_taught as (
      update gateway.lanes
      set paused_until = case when lane_next.pause_ms is null then lanes.paused_until
                              else greatest(lanes.paused_until, now() + lane_next.pause_ms * interval '1 millisecond') end,
          token_allowance = lanes.token_allowance - lane_next.unestimated_tokens,
          failure_streak = lane_next.failure_streak,
          last_failed_request_id = case when lane_next.successes > 0 then null
                                        else coalesce(lane_next.failed_request_id, lanes.last_failed_request_id) end,
          -- A lane that closes starts counting afresh.
          window_started_at = case when lane_next.health = 'healthy' and lane_next.old_health <> 'healthy' then null
                                   else lane_next.window_started_at end,
          window_calls = case when lane_next.health = 'healthy' and lane_next.old_health <> 'healthy' then 0
                              else lane_next.window_calls end,
          window_failures = case when lane_next.health = 'healthy' and lane_next.old_health <> 'healthy' then 0
                                 else lane_next.window_failures end,
          health = lane_next.health,
          health_since = case when (lane_next.health = 'healthy') <> (lane_next.old_health = 'healthy') then now()
                              else lanes.health_since end,
          probe_interval_ms = lane_next.probe_interval_ms,
          probe_at = lane_next.probe_at,
          probe_request_id = lane_next.probe_request_id,
          last_error = coalesce(lane_next.error, lanes.last_error),
          last_error_at = case when lane_next.error is not null then now() else lanes.last_error_at end
      from lane_next
      where lanes.id = lane_next.lane_id
      returning lanes.id, lanes.queue_id, lanes.upstream, lanes.model, lane_next.old_health, lanes.health, lanes.last_error,
                lane_next.unestimated_tokens
    ), corrections as (
      -- What each project's calls' tokens were corrected by, per lane, as the allowance is.
      select lane_id, project_id, sum(unestimated_tokens) as unestimated_tokens
      from outcomes
      join finished using (id)
      where unestimated_tokens <> 0
      group by lane_id, project_id
    ), shares_corrected as (
      -- A project's place in its lane's fair share moves by as much, never behind the lane's
      -- clock (lanes_now: as it is now): a refused prompt costs its project no place.
      update gateway.lane_fair_shares as shares
      set next_start = greatest(lanes.fair_share_clock, shares.next_start + corrections.unestimated_tokens)
      from corrections
      join lanes_now as lanes on lanes.id = corrections.lane_id
      where shares.lane_id = corrections.lane_id and shares.project_id = corrections.project_id
      returning shares.lane_id, shares.project_id
    ), shares_started as (
      -- A project without a row is level with the clock (the clock passed it, perhaps in the claim
      -- that started this very call): tokens used beyond the estimate put it that far ahead, and a
      -- refund leaves it level, as an idle project is. (A row a claim wrote after this statement's
      -- snapshot is not corrected: one call's correction, at most.)
      insert into gateway.lane_fair_shares (lane_id, project_id, next_start, started_at)
      select corrections.lane_id, corrections.project_id, lanes.fair_share_clock + corrections.unestimated_tokens, now()
      from corrections
      join lanes_now as lanes on lanes.id = corrections.lane_id
      where corrections.unestimated_tokens > 0
        and not exists (
          select from shares_corrected
          where shares_corrected.lane_id = corrections.lane_id and shares_corrected.project_id = corrections.project_id)
      on conflict (lane_id, project_id) do nothing
    ), queues_now as (
      -- The queues of the lanes given tokens back, read as they are now (locked to share), not as
      -- the statement's snapshot saw them: a claim that found such a lane without room, and held
      -- it while this statement waited for it, wrote when the queue is to be dispatched after the
      -- snapshot. (A CTE of its own, so that what is asked of the row is asked of it as locked.)
      select queues.id as queue_id, queues.wake_at
      from gateway.queues
      where queues.id in (select queue_id from lanes_taught where unestimated_tokens < 0)
      order by queues.id
      for share
    ), due as (
      -- A queue's retries are dispatched in slots of RETRY_SLOT_MS, each when it ends, by one job
      -- keyed by the queue and the slot: a storm of retries (a 429 to each of hundreds of calls a
      -- second) adds a few jobs a second, not one per retry, each fetched, run and recorded.
      select queue_id, to_timestamp(slot * ${sql.lit(RETRY_SLOT_MS)}::float8 / 1000) as run_at,
             ${sql.lit(RETRY_KEY_PREFIX)} || queue_id || ':' || slot as key
      from (
        select queue_id, ceil(extract(epoch from next_attempt_at) * 1000 / ${sql.lit(RETRY_SLOT_MS)}::float8)::bigint as slot
        from finished where status = 'retrying'
      ) as retries
      union -- (not all: one row, and one job, per queue and slot)
      select queue_id, now(), null from lanes_taught where old_health <> health
      union
      -- Tokens given back to a lane (an attempt without a completion, or a usage below its
      -- estimate) whose queue waits for time to give a lane room: its dispatch was set for when
      -- the allowance would have refilled without them, and the requests waiting may fit now.
      select queue_id, now(), ${sql.lit(TOKENS_BACK_KEY_PREFIX)} || queue_id
      from queues_now
      where wake_at > now()
    ), queued as (
      select count(*) as jobs
      from graphile_worker.add_jobs(array(
        select row(${sql.lit(DISPATCH_QUEUE)}, json_build_object('queue_id', queue_id), null, run_at,
                   null, key, null, null)::graphile_worker.job_spec
        -- In one order, so that statements adding the same keys cannot deadlock.
        from due order by queue_id, run_at
      ), job_key_preserve_run_at => true)
      where exists (select from due)
    ), changes as (
      select coalesce(json_agg(json_build_object('lane_id', id::text, 'upstream', upstream, 'model', model,
                                                 'from', old_health, 'to', health, 'last_error', last_error)), '[]') as list
      from lanes_taught
      where old_health <> health
    )
    -- An attempt whose request this statement did not update was recorded by another first
    -- (read as running, then found ended once its lock was free): null, as a stale one.
    select case when finished.id is not null then outcomes.status end as status, outcomes.charged,
           extract(epoch from finished.next_attempt_at - now())::float8 * 1000 as retry_in_ms,
           changes.list as lane_changes
    from input
    cross join queued
    cross join changes
    left join outcomes on outcomes.ord = input.ord
    left join finished on finished.id = input.id
    order by input.ord
  `,
);

/** The slots of time in which a queue's retries share one dispatch, due when the slot ends. */
export const RETRY_SLOT_MS = 250;
const RETRY_KEY_PREFIX = 'dispatch_retry:';
/** One dispatch pending per queue for tokens given back, however many attempts give them. */
const TOKENS_BACK_KEY_PREFIX = 'dispatch_tokens_back:';

type Completion = Extract<Finish, { kind: 'completed' }>;

/**
 * The common case of finishAttempts in fewer steps (a group of completions is most groups): the
 * same rows written, when none of the group's lanes has anything to learn from a success. A
 * healthy lane with no failure since its last success, no window of failures open and no token
 * allowance to correct is left as it is by finishAttempts too. Returns undefined, having changed
 * nothing, when a lane of the group is in any other state: finishAttempts then records the group.
 * Its lanes are read, not locked: a failure recorded on one at the same moment counts as after
 * these successes.
 */
async function finishCompletions(db: Db, completions: readonly Completion[], rules: LaneHealthRules): Promise<Finished[] | undefined> {
  const { rows } = await completionsStatement.execute(db, { ...columnArrays(COMPLETION_COLUMNS, completions), window_ms: rules.windowMs });
  if (!rows[0]?.plain) return undefined;
  return rows.map((row) => (row.applied ? { status: 'completed', charged: null } : null));
}

/** The lean statement's input columns, each with its type and where a completion has it. */
const COMPLETION_COLUMNS = [
  ['id', 'text', (c: Completion) => c.id],
  ['attempt', 'int', (c: Completion) => c.attempt],
  ['lane_id', 'bigint', (c: Completion) => c.laneId],
  ['result', 'text', (c: Completion) => c.result],
  ['prompt_tokens', 'int', (c: Completion) => c.usage.prompt],
  ['completion_tokens', 'int', (c: Completion) => c.usage.completion],
  ['total_tokens', 'int', (c: Completion) => c.usage.total],
  ['upstream_status', 'int', (c: Completion) => c.upstreamStatus],
  ['duration_ms', 'int', (c: Completion) => c.durationMs],
] as const satisfies readonly InputColumn<Completion>[];

const completionsStatement = statement(
  [...COMPLETION_COLUMNS.map(([name]) => name), 'window_ms'] as const,
  (v) => sql<{ plain: boolean; applied: boolean }>`
    with input as (
      ${unnestRows(COMPLETION_COLUMNS, v)}
    ), lanes_plain as (
      select not exists (
        select from gateway.lanes
        where lanes.id in (select lane_id from input)
          and (lanes.health <> 'healthy' or lanes.failure_streak > 0 or lanes.tokens_per_minute is not null
               or ${windowOpen(v.window_ms)})
      ) as plain
    ), attempt_rows as (
      update gateway.request_attempts
      set outcome = 'succeeded', finished_at = now(), upstream_status = input.upstream_status, duration_ms = input.duration_ms
      from input
      where request_attempts.request_id = input.id and request_attempts.attempt_number = input.attempt
        and request_attempts.outcome = 'running' and (select plain from lanes_plain)
    ), finished as (
      update gateway.requests
      set status = 'completed',
          result = input.result::json,
          result_bytes = octet_length(input.result),
          prompt_tokens = input.prompt_tokens,
          completion_tokens = input.completion_tokens,
          total_tokens = input.total_tokens,
          finished_at = now(),
          next_attempt_at = null,
          updated_at = now()
      from input
      where requests.id = input.id and requests.attempts = input.attempt and requests.status = 'processing'
        and (select plain from lanes_plain)
      returning requests.id
    )
    select (select plain from lanes_plain) as plain, finished.id is not null as applied
    from input
    left join finished on finished.id = input.id
    order by input.ord
  `,
);

/** An attempt left running by a worker that died. */
export interface LostAttempt extends Pick<Selectable<RequestsTable>, 'id' | 'mode' | 'queue_id'> {
  attempt: Selectable<RequestAttemptsTable>['attempt_number'];
  /** Attempts charged to its request before this one. */
  charged: number;
}

/**
 * Attempts still running whose worker is gone: its row in gateway.worker_pools was deleted as
 * dead (or never written), and the attempt started more than `deadAfterMs` ago, so a worker
 * starting up is not mistaken for a dead one; or, however recent, those of the workers in `dead`,
 * whose rows the caller's sweep has just deleted. Never those of the workers in `live`.
 */
export async function findLostAttempts(
  db: Db,
  deadAfterMs: number,
  live: readonly string[],
  limit: number,
  dead: readonly string[] = [],
): Promise<LostAttempt[]> {
  const { rows } = await sql<LostAttempt>`
    select request_attempts.request_id as id, request_attempts.attempt_number as attempt, requests.mode,
           requests.queue_id, requests.charged_attempts as charged
    from gateway.request_attempts
    join gateway.requests on requests.id = request_attempts.request_id
    where request_attempts.outcome = 'running'
      and (request_attempts.started_at < now() - ${deadAfterMs}::float8 * interval '1 millisecond'
           or request_attempts.worker_id = any(${dead}::text[]))
      and not exists (select from gateway.worker_pools where worker_pools.id = request_attempts.worker_id)
      and coalesce(request_attempts.worker_id, '') <> all(${live}::text[])
    limit ${limit}
  `.execute(db);
  return rows;
}

/** The queue of a request that is still waiting or running; undefined otherwise. */
export async function findRequestQueue(db: Db, id: string): Promise<string | undefined> {
  const row = await db
    .selectFrom('requests')
    .select('queue_id')
    .where('id', '=', id)
    .where('finished_at', 'is', null)
    .executeTakeFirst();
  return row?.queue_id ?? undefined;
}

/**
 * The body of a request that is still running, as JSON text: a claim leaves out a large one
 * (lanes/repository.ts claimQueue). undefined once the request has ended.
 */
export async function findBody(db: Db, id: string): Promise<string | undefined> {
  const { rows } = await sql<{ body: string | null }>`
    select body::text as body from gateway.requests where id = ${id} and finished_at is null
  `.execute(db);
  return rows[0]?.body ?? undefined;
}

/** Of these requests, those that have ended. */
export async function findEnded(db: Db, ids: readonly string[]): Promise<string[]> {
  const { rows } = await sql<Pick<Selectable<RequestsTable>, 'id'>>`
    select id from gateway.requests where id = any(${ids}::text[]) and finished_at is not null
  `.execute(db);
  return rows.map((row) => row.id);
}
