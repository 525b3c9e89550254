// Outage 2: the only upstream of a model refuses connections (its port closed) for 120 s while
// 500 requests arrive, then listens again on the same port. None fails, all complete within 30 s
// of the recovery, and the gateway's attempts during the outage (a refused connection never
// reaches the upstream, so they are counted in gateway.request_attempts) average at most 2 a
// second.
import t from 'tap';
import { tally } from '../faults/support/client.ts';
import { runSingleUpstreamOutage } from './single-upstream-outage.ts';

t.test('the upstream refuses connections for 120 s while 500 requests arrive: none fails, all complete within 30 s of recovery, at most 2 failed attempts a second', async (t) => {
  const outcome = await runSingleUpstreamOutage(t, {
    label: 'connection-refused',
    outage: { kind: 'refuse' },
    countedAtUpstream: false,
  });
  const { requests, downAt, upAt, reads } = outcome;
  const duringOutage = requests.flatMap((request) =>
    request.attempt_rows.filter((attempt) => attempt.started_at.getTime() >= downAt && attempt.started_at.getTime() < upAt - 1_000),
  );
  t.same(
    duringOutage.filter((attempt) => attempt.outcome !== 'failed' || attempt.error_code !== 'upstream_connection_error').map((attempt) => `${attempt.outcome} ${attempt.error_code}`).slice(0, 10),
    [],
    `every attempt during the outage failed with upstream_connection_error (${duringOutage.length}: ${tally(duringOutage.map((attempt) => String(attempt.error_code)))})`,
  );
  t.ok(
    reads.some((read) => read.health !== 'healthy' && read.last_error !== null && /upstream_connection_error/.test(read.last_error)),
    'lane_states said open, with last_error naming upstream_connection_error',
  );
  t.equal(outcome.upstream.calls.filter((call) => call.arrivedAt >= downAt && call.arrivedAt < upAt).length, 0, 'no call reached the upstream while its port was closed');
});
