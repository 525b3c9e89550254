// The one backoff of the client and the gateway: doubling waits, jitter, and the Backoff that
// steps through them.
import t from 'tap';
import { Backoff, doubling, jitter } from '../../src/client/backoff.ts';

t.test('doubling: the first wait, doubled for each try after it, up to the ceiling', async (t) => {
  t.same([1, 2, 3, 4, 5, 6, 7].map((n) => doubling(n, 100, 1_000)), [100, 200, 400, 800, 1_000, 1_000, 1_000]);
  t.equal(doubling(10_000, 100, 1_000), 1_000, 'however many tries');
  t.equal(doubling(10_000, 0, 1_000), 0, 'a first wait of 0 stays 0');
  t.same([1, 2, 3].map((n) => doubling(n, 500, 100)), [500, 500, 500], 'a ceiling below the first wait is none');
});

t.test('jitter: uniformly from ms * (1 - less) to ms * (1 + more)', async (t) => {
  t.equal(jitter(1_000, 1, 0, () => 0), 0, 'full jitter: from 0');
  t.equal(jitter(1_000, 1, 0, () => 0.5), 500);
  t.equal(jitter(1_000, 0.25, 0, () => 0), 750, 'less up to a quarter');
  t.equal(jitter(1_000, 0.25, 0, () => 1), 1_000);
  t.equal(jitter(5_000, 0.1, 0.1, () => 0), 4_500, 'give or take a tenth');
  t.equal(jitter(5_000, 0.1, 0.1, () => 1), 5_500);
  const draws = Array.from({ length: 2_000 }, () => jitter(1_000, 0.2));
  t.ok(draws.every((ms) => ms >= 800 && ms <= 1_000), 'within the bounds');
  t.ok(new Set(draws).size > 100, 'spread out, not one value');
  const mean = draws.reduce((sum, ms) => sum + ms, 0) / draws.length;
  t.ok(mean > 880 && mean < 920, `around the middle: ${mean.toFixed(0)}`);
});

t.test('Backoff steps through the doubling waits, and starts again after reset()', async (t) => {
  const backoff = new Backoff(100, 1_000);
  t.equal(backoff.upcoming, 100);
  t.same([backoff.next(), backoff.next(), backoff.next(), backoff.next()], [100, 200, 400, 800]);
  t.equal(backoff.upcoming, 1_000);
  t.same([backoff.next(), backoff.next()], [1_000, 1_000]);
  backoff.reset();
  t.equal(backoff.upcoming, 100);
  t.equal(backoff.next(), 100);
});
