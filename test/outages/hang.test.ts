// Outage 3: the only upstream of a model hangs every call for 120 s (no answer; the gateway's
// UPSTREAM_TIMEOUT_MS of 5 s ends each) while 500 requests arrive. A call that arrived during the
// outage keeps hanging after it, as a real one would. None fails, all complete within 30 s of
// the recovery, and the calls that hung average at most 2 a second.
import t from 'tap';
import { spread } from '../faults/support/client.ts';
import { runSingleUpstreamOutage } from './single-upstream-outage.ts';

const UPSTREAM_TIMEOUT_MS = 5_000;

t.test('the upstream hangs every call for 120 s while 500 requests arrive: none fails, all complete within 30 s of recovery, at most 2 hung calls a second', async (t) => {
  const outcome = await runSingleUpstreamOutage(t, {
    label: 'hang',
    outage: { kind: 'hang' },
    env: { UPSTREAM_TIMEOUT_MS: String(UPSTREAM_TIMEOUT_MS) },
    countedAtUpstream: true,
  });
  const { upstream, requests, downAt, upAt, reads } = outcome;
  // Only a call that hung goes unanswered: the others met a healthy upstream.
  const hung = upstream.calls.filter((call) => call.status === undefined);
  t.ok(hung.length > 0, `calls hung during the outage (${hung.length})`);
  t.same(hung.filter((call) => call.endedAt === undefined).length, 0, 'the gateway gave up every hung call: none is still open');
  // By the gateway's own count (each timed-out attempt's duration_ms): the upstream, in this busy
  // test process, gets to a call's body some time after the gateway's timer started, a second
  // and more on a slow machine.
  const durations = requests.flatMap((request) =>
    request.attempt_rows.filter((attempt) => attempt.error_code === 'upstream_timeout').map((attempt) => attempt.duration_ms ?? Infinity),
  );
  t.ok(durations.length >= hung.length, `a timed-out attempt for each hung call (${durations.length} for ${hung.length})`);
  t.same(
    durations.filter((ms) => ms < UPSTREAM_TIMEOUT_MS - 1_000 || ms > UPSTREAM_TIMEOUT_MS + 3_000),
    [],
    `each after about UPSTREAM_TIMEOUT_MS (${durations.length} attempts: ${spread(durations)})`,
  );
  const timedOut = requests.flatMap((request) => request.attempt_rows.filter((attempt) => attempt.started_at.getTime() >= downAt && attempt.started_at.getTime() < upAt - UPSTREAM_TIMEOUT_MS));
  t.same(
    timedOut.filter((attempt) => attempt.error_code !== 'upstream_timeout').map((attempt) => `${attempt.outcome} ${attempt.error_code}`).slice(0, 10),
    [],
    `every attempt during the outage ended with upstream_timeout (${timedOut.length})`,
  );
  t.ok(
    reads.some((read) => read.health !== 'healthy' && read.last_error !== null && /upstream_timeout/.test(read.last_error)),
    'lane_states said open, with last_error naming upstream_timeout',
  );
  const atUpstream = hung.map((call) => (call.endedAt ?? Date.now()) - call.arrivedAt);
  t.comment(`${hung.filter((call) => call.arrivedAt < upAt && (call.endedAt ?? Infinity) > upAt).length} calls made during the outage were still hanging when it ended; hung call durations at the upstream: ${spread(atUpstream)}`);
});
