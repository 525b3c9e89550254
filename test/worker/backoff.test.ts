// Full-jitter exponential backoff, and retry-after.
import t from 'tap';
import { retryDelay } from '../../src/worker/attempts.ts';

const settings = { retryBaseMs: 100, retryMaxMs: 1_000 };

t.test('the delay is drawn from [0, min(max, base * 2^(n-1))]', async (t) => {
  const ceilings = [100, 200, 400, 800, 1_000, 1_000];
  ceilings.forEach((ceiling, index) => {
    const attempt = index + 1;
    t.equal(retryDelay(settings, attempt, undefined, () => 0), 0, `attempt ${attempt}: lowest`);
    t.equal(retryDelay(settings, attempt, undefined, () => 0.999999), ceiling - 1, `attempt ${attempt}: highest`);
  });
  const draws = Array.from({ length: 2_000 }, () => retryDelay(settings, 3));
  t.ok(draws.every((delay) => delay >= 0 && delay < 400));
  t.ok(new Set(draws).size > 100, 'spread out, not one value');
});

t.test('a retry-after longer than the backoff wins; a shorter one does not', async (t) => {
  t.equal(retryDelay(settings, 1, 5_000, () => 0.5), 5_000);
  t.equal(retryDelay(settings, 4, 10, () => 0.5), 400);
  t.equal(retryDelay(settings, 1, 10 * 24 * 3600 * 1000, () => 0), 3600 * 1000, 'capped at an hour');
});
