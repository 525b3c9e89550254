// Waiting for a condition in a test: by polling, with a bound.
import { setTimeout as sleep } from 'node:timers/promises';

/** Polls `check` until it holds; false if it still does not after `timeoutMs`. */
export async function waitFor(check: () => Promise<boolean> | boolean, timeoutMs: number, everyMs = 50): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    if (await check()) return true;
    if (Date.now() > deadline) return false;
    await sleep(everyMs);
  }
}

/**
 * Polls `check` until it holds; throws, naming `what` (a function: what to say at that moment),
 * if it still does not after `timeoutMs`.
 */
export async function until(
  check: () => Promise<boolean> | boolean,
  what: string | (() => string),
  timeoutMs = 5_000,
): Promise<void> {
  if (!(await waitFor(check, timeoutMs, 10))) {
    throw new Error(`timed out waiting: ${typeof what === 'string' ? what : what()}`);
  }
}
