// A lane's change of health, told to operators: a log line and gateway_lane_health_changes_total,
// by the process that made it (the statement recording attempts' ends opens and closes lanes; a
// dispatch starts a probe, and opens a lane again when its probe ended without a word).
import type { Logger } from '../logger.ts';
import type { Metrics } from '../metrics.ts';
import type { LaneChange } from './attempts-repository.ts';

export function reportLaneChange(deps: { metrics: Metrics; log: Logger }, change: LaneChange): void {
  deps.metrics.laneHealthChanges.inc({ upstream: change.upstream, health: change.to });
  const fields = { laneId: change.laneId, upstream: change.upstream, model: change.model, from: change.from, to: change.to, reason: change.lastError };
  if (change.to === 'open') deps.log.warn(fields, 'lane health changed');
  else deps.log.info(fields, 'lane health changed');
}
