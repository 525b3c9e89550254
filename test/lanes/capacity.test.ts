// A worker process's in-flight capacity: MAX_IN_FLIGHT live calls at most (the rest wait in
// their lane, charged nothing), 90 % of them for one upstream when there are several (the rest
// is the others' reserves), and test-mode calls in capacity of their own, so that test traffic
// at full load leaves live latency as it was.
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { completionAfter, startFakeUpstream } from '../helpers/upstream.ts';
import { until } from '../helpers/wait.ts';
import { upstreamReserve } from '../../src/worker/dispatcher.ts';
import { writeUpstreamsFile } from '../outages/support.ts';

t.test('MAX_IN_FLIGHT caps the calls a worker has under way; the others wait, charged nothing', async (t) => {
  const upstream = await startFakeUpstream(t, completionAfter(300));
  // Six rounds of calls of 300 ms: on a busy machine the last ones end after the suite's 3 s wait.
  const gateway = await startTestGateway(t, { env: { UPSTREAM_BASE_URL: upstream.baseUrl, MAX_IN_FLIGHT: '5', WAIT_TIMEOUT_MS: '30000' } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const answers = await Promise.all(
    Array.from({ length: 30 }, (_, i) => client.post({ model: 'gpt-x', messages: userMessage(`n${i}`), wait: true })),
  );
  t.same(new Set(answers.map((answer) => answer.status)), new Set([200]), 'all 30 completed');
  t.equal(upstream.peakInFlight(), 5, 'five calls at once, never more');
  const { rows } = await gateway.pool.query('select count(*)::int as count from gateway.requests where attempts <> 1');
  t.equal(rows[0].count, 0, 'each in one attempt');
});

t.test('MAX_IN_FLIGHT holds while many lanes are dispatched at once: their claims never take the same room twice', async (t) => {
  const upstream = await startFakeUpstream(t, completionAfter(250));
  const env = { UPSTREAM_BASE_URL: upstream.baseUrl, MAX_IN_FLIGHT: '5', WORKER_CONCURRENCY: '16' };
  const api = await startTestGateway(t, { role: 'api', env });
  const client = clientFor(api.url, await api.createKey({ mode: 'live' }));
  // Eight models, eight lanes, ten requests each, all queued before the worker starts: its
  // dispatch_lane jobs for the eight lanes run at the same time, each finding the same room.
  const accepted = await Promise.all(
    Array.from({ length: 80 }, (_, i) => client.post({ model: `gpt-lane-${i % 8}`, messages: userMessage(`n${i}`) })),
  );
  t.same(new Set(accepted.map((answer) => answer.status)), new Set([202]), 'all 80 accepted');
  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl, env });
  await until(async () => {
    const { rows } = await api.pool.query(`select count(*)::int as count from gateway.requests where status = 'completed'`);
    return rows[0].count === 80;
  }, 'all 80 completed', 30_000);
  t.equal(upstream.peakInFlight(), 5, `five calls at once, never more (${upstream.peakInFlight()} at the most)`);
});

t.test('with two upstreams, one holds at most 90 % of MAX_IN_FLIGHT; with one, all of it', async (t) => {
  t.equal(upstreamReserve(13_107, 1), 0, 'a single upstream: no reserve, the whole capacity is its');
  t.equal(upstreamReserve(13_107, 2), 1_311, 'two: the other\'s reserve is the 10 % beyond 90 % (11,796 calls)');
  t.equal(upstreamReserve(13_107, 3), 655, 'three: those 10 % split between the two others');
  t.equal(upstreamReserve(10, 3), 1, 'one call each at least');
  t.equal(upstreamReserve(10, 20), 0, 'and none when the capacity has not one for each upstream');

  const busy = await startFakeUpstream(t, completionAfter(300));
  const other = await startFakeUpstream(t, completionAfter(0));
  const upstreamsFile = await writeUpstreamsFile(t, [
    { name: 'busy', base_url: busy.baseUrl, models: ['gpt-busy'] },
    { name: 'other', base_url: other.baseUrl, models: ['gpt-other'] },
  ]);
  const gateway = await startTestGateway(t, { env: { UPSTREAMS_FILE: upstreamsFile, MAX_IN_FLIGHT: '10', WAIT_TIMEOUT_MS: '30000' } });
  const client = clientFor(gateway.url, await gateway.createKey({ mode: 'live' }));
  const answers = await Promise.all(
    Array.from({ length: 30 }, (_, i) => client.post({ model: 'gpt-busy', messages: userMessage(`n${i}`), wait: true })),
  );
  t.same(new Set(answers.map((answer) => answer.status)), new Set([200]), 'all 30 completed');
  t.equal(busy.peakInFlight(), 9, 'nine calls at once on the busy upstream, never more');
});

t.test('test traffic at full load leaves live latency unchanged', async (t) => {
  const upstream = await startFakeUpstream(t, completionAfter(200));
  const gateway = await startTestGateway(t, {
    env: { UPSTREAM_BASE_URL: upstream.baseUrl, TEST_MAX_IN_FLIGHT: '50', MAX_IN_FLIGHT: '50', UPSTREAM_TIMEOUT_MS: '30000' },
  });
  const live = clientFor(gateway.url, await gateway.createKey({ project: 'live-project', mode: 'live' }));
  const test = clientFor(gateway.url, await gateway.createKey({ project: 'test-project', mode: 'test' }));
  /** 20 live wait=true requests, 5 at a time; each one's latency in ms. */
  const liveLatencies = async (label: string) => {
    const latencies: number[] = [];
    for (let batch = 0; batch < 4; batch++) {
      await Promise.all(
        Array.from({ length: 5 }, async (_, i) => {
          const started = performance.now();
          const answer = await live.post({ model: 'gpt-x', messages: userMessage(`${label} ${batch} ${i}`), wait: true });
          if (answer.status !== 200) throw new Error(`live request not completed: ${answer.text}`);
          latencies.push(performance.now() - started);
        }),
      );
    }
    return latencies.sort((a, b) => a - b);
  };

  const quiet = await liveLatencies('quiet');
  // The test lane filled: 50 simulated calls of 25 s in flight (its whole capacity), 450 waiting.
  // Calls that long (within UPSTREAM_TIMEOUT_MS) outlast the filling and the measuring below
  // however busy the machine is: no call ends, and none of the waiting ones takes its place,
  // while live latency is measured.
  const flood = await Promise.all(
    Array.from({ length: 500 }, (_, i) => test.post({ model: 'test-delay-25000', messages: userMessage(`flood ${i}`) })),
  );
  t.same(new Set(flood.map((answer) => answer.status)), new Set([202]), 'the test flood accepted');
  await until(async () => {
    const { rows } = await gateway.pool.query(`select count(*)::int as count from gateway.requests where mode = 'test' and status = 'processing'`);
    return rows[0].count === 50;
  }, 'the test capacity full', 10_000);
  const loaded = await liveLatencies('loaded');
  const { rows } = await gateway.pool.query(`select count(*)::int as count from gateway.requests where mode = 'test' and status = 'processing'`);
  t.equal(rows[0].count, 50, 'the test capacity stayed full throughout');

  const median = (values: number[]) => values[Math.floor(values.length / 2)]!;
  t.comment(`live latency, quiet: median ${median(quiet).toFixed(0)} ms, max ${quiet.at(-1)!.toFixed(0)} ms; with the test lane full: median ${median(loaded).toFixed(0)} ms, max ${loaded.at(-1)!.toFixed(0)} ms`);
  // The live calls take 200 ms upstream; waiting behind the test traffic would add seconds.
  t.ok(median(loaded) < median(quiet) + 100, 'the median live latency is unchanged (within 100 ms)');
  t.ok(loaded.at(-1)! < 1_000, 'and no live request waited for the test traffic');
});
