// Work in flight at shutdown (upstream calls, webhook tries): given SHUTDOWN_GRACE_MS to land,
// then aborted, and awaited to the end either way.

export interface InFlight {
  controller: AbortController;
  /** Settles once the work has landed, aborted or not. */
  done: Promise<unknown>;
}

/**
 * Waits for what `inFlight()` lists to land, for `graceMs` at most; then aborts what is left with
 * `reason`, calls `graceOver`, and waits for all of it.
 */
export async function landWithin(
  graceMs: number,
  inFlight: () => Iterable<InFlight>,
  reason: string,
  graceOver?: () => void,
): Promise<void> {
  const all = () => Promise.all([...inFlight()].map((flight) => flight.done));
  let timer: NodeJS.Timeout | undefined;
  const grace = new Promise<void>((resolve) => (timer = setTimeout(resolve, graceMs)));
  await Promise.race([all(), grace]);
  clearTimeout(timer);
  for (const flight of inFlight()) flight.controller.abort(reason);
  graceOver?.();
  await all();
}
