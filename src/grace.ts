// Work in flight (upstream calls, webhook tries): why it is aborted, and how it lands at
// shutdown: given SHUTDOWN_GRACE_MS, then aborted, and awaited to the end either way.

/** Why work in flight was aborted (AbortController.abort's reason, read back as signal.reason). */
export const ABORTED_BY_SHUTDOWN = 'shutdown';
export const ABORTED_BY_TIMEOUT = 'timeout';
/** A call's request ended meanwhile (cancelled, or finished by another worker): its attempt is recorded already. */
export const ABORTED_AS_ENDED = 'ended';

/**
 * Aborts work in flight with ABORTED_BY_TIMEOUT after `ms`, once this process has read its
 * sockets: a process held off the CPU (a busy host) wakes with its timers due before it reads what
 * arrived meanwhile, and an answer (or a reset) that came in time would otherwise be thrown away
 * as a timeout. An immediate runs after the event loop's next look at its sockets; a reset is
 * reported as its socket's handle closes, in the phase after that, hence two. clearTimeout before
 * the time is up stops it; an abort after the work has landed changes nothing.
 */
export function abortAfter(controller: AbortController, ms: number): NodeJS.Timeout {
  return setTimeout(() => setImmediate(() => setImmediate(() => controller.abort(ABORTED_BY_TIMEOUT))), ms);
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
