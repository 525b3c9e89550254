// Outage 1: the only upstream of a model answers 503 for 120 s while 500 requests arrive. None
// fails, all complete within 30 s of the recovery, and the gateway's calls during the outage
// (counted at the upstream) average at most 2 a second: the lane opens and probes, one call at
// a time, at intervals that double up to 15 s.
import t from 'tap';
import { seconds } from './support.ts';
import { runSingleUpstreamOutage } from './single-upstream-outage.ts';

const PROBE_MAX_MS = 15_000;

t.test('the upstream answers 503 for 120 s while 500 requests arrive: none fails, all complete within 30 s of recovery, at most 2 failed calls a second', async (t) => {
  const outcome = await runSingleUpstreamOutage(t, {
    label: '503',
    outage: { kind: 'status', status: 503 },
    countedAtUpstream: true,
  });
  const { upstream, openedAt, downAt, upAt, reads } = outcome;

  // Probing: after the lane opened, the calls came at growing intervals, never more than the
  // ceiling apart (with a margin for a busy machine).
  const whileOpen = upstream.calls.filter((call) => openedAt !== undefined && call.arrivedAt >= openedAt + 500 && call.arrivedAt < upAt);
  const gaps = whileOpen.slice(1).map((call, i) => call.arrivedAt - whileOpen[i]!.arrivedAt);
  t.ok(whileOpen.length >= 5, `the lane was probed during the outage (${whileOpen.length} probe calls)`);
  t.ok(gaps.every((gap) => gap <= PROBE_MAX_MS + 2_000), `probes at most ${seconds(PROBE_MAX_MS)} apart (longest gap ${seconds(Math.max(0, ...gaps))})`);
  t.ok(whileOpen.every((call) => call.status === 503), 'every probe met the 503');
  t.ok(
    reads.some((read) => read.health === 'open' && read.last_error !== null && /upstream_server_error/.test(read.last_error)),
    'lane_states said open, with last_error naming upstream_server_error',
  );
  t.comment(`first probe ${whileOpen[0] ? seconds(whileOpen[0].arrivedAt - downAt) : 'never'} into the outage`);
});
