// Outage 8: the upstream refuses the operator's key (401) for 60 s, then accepts it again. A 401
// is the upstream's fault, not the request's: the requests wait (none fails), gateway.lane_states
// shows the lane open or probing with a last_error naming upstream_auth_error, and once the key
// is accepted all complete.
import t from 'tap';
import { tally } from '../faults/support/client.ts';
import { runSingleUpstreamOutage } from './single-upstream-outage.ts';

t.test('the upstream answers 401 for 60 s, then accepts: requests wait, none failed, the lane shows upstream_auth_error, then all complete', async (t) => {
  const outcome = await runSingleUpstreamOutage(t, {
    label: 'auth-refused',
    outage: { kind: 'status', status: 401 },
    countedAtUpstream: true,
    requests: 120,
    outageMs: 60_000,
  });
  const { reads, requests, upAt } = outcome;
  const shown = reads.filter((read) => (read.health === 'open' || read.health === 'probing') && read.last_error !== null && /upstream_auth_error/.test(read.last_error));
  t.ok(shown.length > 0, `lane_states showed the lane open or probing with last_error naming upstream_auth_error (${shown.length} of ${reads.length} reads)`);
  t.comment(`last_error as shown: ${[...new Set(shown.map((read) => read.last_error))].join(' | ') || 'never'}`);
  const refused = requests.flatMap((request) => request.attempt_rows.filter((attempt) => attempt.started_at.getTime() < upAt - 1_000 && attempt.outcome === 'failed'));
  t.same(
    [...new Set(refused.map((attempt) => attempt.error_code))],
    ['upstream_auth_error'],
    `the attempts refused were recorded as upstream_auth_error (${tally(refused.map((attempt) => `charged ${attempt.charged}`))})`,
  );
});
