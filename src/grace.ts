// Work in flight (upstream calls, webhook tries): why it is aborted, and how it lands at
// shutdown: given SHUTDOWN_GRACE_MS, then aborted, and awaited to the end either way.

/** Why work in flight was aborted (AbortController.abort's reason, read back as signal.reason). */
export const ABORTED_BY_SHUTDOWN = 'shutdown';
export const ABORTED_BY_TIMEOUT = 'timeout';
/** A call's request ended meanwhile (cancelled, or finished by another worker): its attempt is recorded already. */
export const ABORTED_AS_ENDED = 'ended';

/** How long work in flight outlives its timeout while its process runs (abortAfter). */
export const READ_GRACE_MS = 50;

/**
 * Aborts work in flight with ABORTED_BY_TIMEOUT after `ms`, once this process has run for
 * READ_GRACE_MS since: a process held off the CPU (a busy host) wakes with its timers due before it
 * has read what arrived meanwhile, and an answer, a reset or a close that came in time would
 * otherwise be thrown away as a timeout (undici reports a reset or a close a few turns of the event
 * loop after it is read). The second timer starts when the first fires, so the grace is counted
 * from the moment the process runs again. Returns what stops it, whichever timer is pending: for
 * work that has landed.
 */
export function abortAfter(controller: AbortController, ms: number): () => void {
  let timer = setTimeout(() => {
    timer = setTimeout(() => controller.abort(ABORTED_BY_TIMEOUT), READ_GRACE_MS);
  }, ms);
  return () => clearTimeout(timer);
}

export interface InFlight {
  controller: AbortController;
  /** Settles once the work has landed, aborted or not. */
  done: Promise<unknown>;
}

/**
 * Waits for what `inFlight()` lists to land, for `graceMs` at most; then aborts what is left
 * (ABORTED_BY_SHUTDOWN), calls `graceOver`, and waits for all of it.
 */
export async function landWithin(graceMs: number, inFlight: () => Iterable<InFlight>, graceOver?: () => void): Promise<void> {
  const all = () => Promise.all([...inFlight()].map((flight) => flight.done));
  let timer: NodeJS.Timeout | undefined;
  const grace = new Promise<void>((resolve) => (timer = setTimeout(resolve, graceMs)));
  await Promise.race([all(), grace]);
  clearTimeout(timer);
  for (const flight of inFlight()) flight.controller.abort(ABORTED_BY_SHUTDOWN);
  graceOver?.();
  await all();
}
