// A read that many callers want often and that may be a little old: the gauges read from the
// database (metrics.ts) and /readyz's look at the schema (http/routes/ops.ts).

/**
 * `read`, run at most once per `ttlMs` (counted from the end of the last read), its answer
 * shared by every caller meanwhile, and never twice at once (callers that come during a read
 * wait for it). So however often, and by however many, it is called, `read` runs at most once
 * per `ttlMs`. A failed read is not kept: the next call tries again (a caller that wants a
 * failure kept too returns it as a value).
 */
export function sharedRead<T>(read: () => Promise<T>, ttlMs: number): () => Promise<T> {
  let kept: { value: T; until: number } | undefined;
  let reading: Promise<T> | undefined;
  return () => {
    if (kept && performance.now() < kept.until) return Promise.resolve(kept.value);
    reading ??= read()
      .then((value) => {
        kept = { value, until: performance.now() + ttlMs };
        return value;
      })
      .finally(() => {
        reading = undefined;
      });
    return reading;
  };
}
