// When a lane opens, and how it probes while open. The lane's state lives in its row
// (gateway.lanes), written by the statement that records the attempts' ends
// (worker/attempts-repository.ts) and read by the claim (gateway.claim_queue), so that it holds
// across every worker process.

export interface LaneHealthRules {
  /** Failures in a row, of different requests, for the provider's reasons, that open a lane. */
  openAfterStreak: number;
  /** A lane also opens when most of a window's calls failed, at least this many. */
  windowMinFailures: number;
  windowMs: number;
  /** The wait before the first probe of an open lane; it doubles after each failed probe, up to probeMaxMs. */
  probeMinMs: number;
  probeMaxMs: number;
}

export const LANE_HEALTH: LaneHealthRules = Object.freeze({
  openAfterStreak: 5,
  windowMinFailures: 10,
  windowMs: 60_000,
  probeMinMs: 1_000,
  // A provider back from an outage is found within this (and a probe's own call): short enough
  // that the backlog starts again promptly, long enough that probes stay a trickle.
  probeMaxMs: 15_000,
});
