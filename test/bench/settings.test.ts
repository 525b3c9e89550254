// The benchmark's BENCH_* settings (bench/settings.ts), read and bounded before anything runs.
import t from 'tap';
import { loadSettings } from '../../bench/settings.ts';

t.test('BENCH_DURATION of less than a second is refused: no window to divide by, no whole second to count', async (t) => {
  for (const value of ['0', '0.5']) {
    t.throws(() => loadSettings({ BENCH_DURATION: value }), /BENCH_DURATION/, `BENCH_DURATION=${value}`);
  }
  t.equal(loadSettings({ BENCH_DURATION: '1' }).durationMs, 1_000);
  t.equal(loadSettings({ BENCH_DURATION: '2.5' }).durationMs, 2_500);
  t.equal(loadSettings({}).durationMs, 15_000, 'the default');
});

t.test('BENCH_WARMUP may be 0: no warm-up', async (t) => {
  t.equal(loadSettings({ BENCH_WARMUP: '0' }).warmupMs, 0);
  t.throws(() => loadSettings({ BENCH_WARMUP: '-1' }), /BENCH_WARMUP/);
});
