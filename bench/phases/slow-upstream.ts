// A slow upstream: every live call takes BENCH_UPSTREAM_DELAY_MS (2 s) to answer, as a long
// generation does, so calls pile up in flight in the worker. An API process and a worker process
// (UPSTREAM_BASE_URL: a loopback upstream in a process of its own, bench/slow-upstream.ts) take
// BENCH_SLOW_REQUESTS signed wait=false requests of a live key twice, each time until every one
// has completed:
//
// 1. A backlog, for the calls one worker keeps in flight and what they cost it: the requests
//    wait for a paused lane (gateway.lanes.paused_until, as an upstream's 429 would leave it)
//    until all are stored, then the lane is let go and the worker starts as many at once as its
//    capacity allows; these calls take BACKLOG_DELAY_MS. Its gauge of calls in flight (/metrics) and its resident memory are read
//    every SAMPLE_MS: the extra memory per 10,000 calls in flight is the highest reading near the
//    peak, less the reading before any load, per call at the peak, times 10,000.
// 2. A stream, for whether the worker keeps up: submitted as fast as the API answers them, while
//    the worker runs them. The rates come from the rows' created_at and finished_at, the
//    database's clock: accepting is the stored requests over the first to last created_at;
//    completing, the completed ones over the first to last finished_at (the same pipeline, later
//    by the delay). If the worker keeps up with the API, the two are equal.
import { randomBytes } from 'node:crypto';
import path from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { cpuLine, type PhaseContext, type PhaseResult } from '../context.ts';
import { CpuMeter, type CpuShares } from '../cpu.ts';
import { gatewayCommand, residentBytesOf, type GatewayProcess } from '../gateway.ts';
import { HttpConnection } from '../http.ts';
import { checks, closedLoop } from '../load.ts';
import { RequestSigner, sha256Hex } from '../signing.ts';
import { increment, Samples } from '../stats.ts';
import { SlowUpstream } from '../upstream.ts';
import { COMPLETIONS, completionBody, errorLine, mb, ms, rate, waitUntilFinished } from './common.ts';

export const SLOW_RATIO_TARGET = 0.9;
export const SLOW_MEMORY_TARGET_BYTES = 300 * 1024 * 1024;
/** Any model goes to the one upstream of UPSTREAM_BASE_URL: one lane each, for the two parts. */
const MODEL = 'bench-slow-upstream';
/**
 * The backlog's calls take 10 s (the upstream reads the delay from the model's name): a worker
 * starting about 1,500 calls a second (this machine, each on a new connection) has more than
 * 10,000 under way before the first answers.
 */
const BACKLOG_DELAY_MS = 10_000;
const BACKLOG_MODEL = `bench-slow-backlog-${BACKLOG_DELAY_MS}ms`;
const SAMPLE_MS = 100;
/** Readings of the idle worker before the load: the heap's baseline is the last of them (resident memory is read as the load starts). */
const BASELINE_MS = 1_000;
/** In-flight readings at least this share of the peak count as "at the peak" for memory. */
const NEAR_PEAK = 0.9;
/** Bounds on submitting, and then on waiting for every request to finish. */
const SUBMIT_TIMEOUT_MS = 300_000;
const SETTLE_TIMEOUT_MS = 180_000;
/** UPSTREAM_TIMEOUT_MS is the delay plus this: a busy machine must not turn slow answers into timeouts. */
const TIMEOUT_MARGIN_MS = 120_000;
const IN_FLIGHT = /^gateway_upstream_calls_in_flight\{mode="live"\} (\d+)/m;
// From the same answer, what explains the memory and the pace: the V8 heap in use, and the longest
// the worker's event loop was held up since the last reading (prom-client's default metrics).
const HEAP_USED = /^gateway_nodejs_heap_size_used_bytes (\d+)/m;
const LOOP_LAG_MAX = /^gateway_nodejs_eventloop_lag_max_seconds ([\d.e+-]+)/m;

export async function slowUpstreamPhase(ctx: PhaseContext): Promise<PhaseResult> {
  const upstream = await SlowUpstream.start(ctx.settings.upstreamDelayMs, path.join(ctx.run.runDir, `${ctx.name}-upstream.log`));
  try {
    return await measure(ctx, upstream);
  } finally {
    await upstream.stop();
  }
}

async function measure(ctx: PhaseContext, upstream: SlowUpstream): Promise<PhaseResult> {
  const { slowRequests, upstreamDelayMs, connections } = ctx.settings;
  const metricsToken = randomBytes(16).toString('hex');
  const settings = {
    UPSTREAM_BASE_URL: upstream.baseUrl,
    // Every live model goes to that upstream, whatever UPSTREAMS_FILE the caller's environment names.
    UPSTREAMS_FILE: '',
    UPSTREAM_TIMEOUT_MS: String(upstreamDelayMs + TIMEOUT_MARGIN_MS),
    // It also puts the worker's /metrics on its PORT (without it, no port serves them).
    METRICS_TOKEN: metricsToken,
  };
  const env = { databaseUrl: ctx.databaseUrl, secretEncryptionKey: ctx.run.secretEncryptionKey, settings };
  const key = JSON.parse(await gatewayCommand(env, ['keys', 'create', '--project', 'bench', '--mode', 'live', '--json'])) as {
    api_key: string;
    signing_secret: string;
  };
  const [api, worker] = await ctx.start(['api', 'worker'], settings);
  const signer = new RequestSigner({ apiKey: key.api_key, signingSecret: key.signing_secret }, `127.0.0.1:${api!.port}`);
  const submit = (model: string) => {
    const body = completionBody({ wait: false, model });
    const bodySha256 = sha256Hex(body);
    return closedLoop({
      port: api!.port,
      connections,
      warmupMs: 0,
      durationMs: SUBMIT_TIMEOUT_MS,
      maxRequests: slowRequests,
      request: () => signer.post(COMPLETIONS, body, bodySha256),
      check: checks.status(202, '"object":"chat.completion.async"'),
    });
  };

  const sampler = sampleWorker(worker!, metricsToken);
  await sleep(BASELINE_MS);
  const rssBefore = residentBytesOf(worker!.pid);
  const heapBefore = sampler.readings.at(-1)?.heapUsed ?? Number.NaN;

  // 1. The backlog: stored while its lane is paused, then let go at once.
  await ctx.query((client) =>
    client.query(
      `with queue as (insert into gateway.queues (mode, model) values ('live', $1) returning id)
       insert into gateway.lanes (mode, upstream, model, queue_id, paused_until)
       select 'live', 'default', $1, id, now() + interval '1 hour' from queue`,
      [BACKLOG_MODEL],
    ),
  );
  const backlogLoad = await submit(BACKLOG_MODEL);
  const releasedAt = performance.now();
  await ctx.query(async (client) => {
    const { rows } = await client.query<{ id: string }>(
      `with lane as (update gateway.lanes set paused_until = null where model = $1 returning queue_id)
       update gateway.queues set wake_at = null from lane where queues.id = lane.queue_id returning queues.id`,
      [BACKLOG_MODEL],
    );
    await client.query(`select graphile_worker.add_job('dispatch_queue', json_build_object('queue_id', $1::bigint))`, [rows[0]!.id]);
  });
  const backlogSettled = await waitUntilFinished(ctx, SETTLE_TIMEOUT_MS);
  const drainedMs = performance.now() - releasedAt;
  const upstreamAfterBacklog = await upstream.stats();
  const backlogRows = await storedFigures(ctx, BACKLOG_MODEL);
  const backlogComplete =
    backlogSettled && backlogRows.completed === slowRequests && backlogRows.failed === 0 && backlogLoad.errors.size === 0;
  const drain = sampler.readings.filter((reading) => reading.at >= releasedAt);
  const peak = drain.reduce((most, reading) => Math.max(most, reading.inFlight), 0);
  const atPeak = drain.find((reading) => reading.inFlight === peak);
  const nearPeak = drain.filter((reading) => peak > 0 && reading.inFlight >= NEAR_PEAK * peak);
  const rssNearPeak = nearPeak.reduce((most, reading) => Math.max(most, reading.rss), 0);
  const extraPer10k = peak > 0 ? ((rssNearPeak - rssBefore) / peak) * 10_000 : Number.NaN;
  const heapNearPeak = nearPeak.map((reading) => reading.heapUsed).filter(Number.isFinite);
  // Heap in use swings with garbage between collections; its lowest per call, while many calls
  // are in flight, is nearer what the calls themselves keep.
  const leanest = drain
    .filter((reading) => peak > 0 && reading.inFlight >= peak / 2)
    .map((reading) => ({ reading, perCall: (reading.heapUsed - heapBefore) / reading.inFlight }))
    .filter(({ perCall }) => Number.isFinite(perCall))
    .sort((a, b) => a.perCall - b.perCall)[0];
  const afterBacklog = sampler.readings.at(-1);

  // 2. The stream: submitted while the worker runs them.
  const upstreamBefore = await upstream.stats();
  const loadStart = performance.now();
  const meter = ctx.cpuMeter();
  // The same window with only the worker as "gateway" (the API then counts as the load generator,
  // whose child it is): the difference between the two is the API's share.
  const workerMeter = new CpuMeter({
    gatewayPids: () => [worker!.pid],
    postmasterPid: ctx.run.server.postmasterPid,
    database: () => ctx.database,
  });
  const load = await submit(MODEL);
  const submitMs = performance.now() - loadStart;
  const settled = await waitUntilFinished(ctx, SETTLE_TIMEOUT_MS);
  const settleMs = performance.now() - loadStart - submitMs;
  const [cpu, workerCpu] = await Promise.all([meter.end(), workerMeter.end()]);
  await sampler.stop();
  const upstreamAfter = await upstream.stats();

  const rows = await storedFigures(ctx, MODEL);
  const acceptRate = rows.stored / rows.acceptSeconds;
  const completionRate = rows.completed / rows.completeSeconds;
  const ratio = completionRate / acceptRate;
  const endToEndRate = rows.completed / rows.endToEndSeconds;
  const complete = settled && rows.completed === slowRequests && rows.failed === 0 && load.errors.size === 0;
  const stream = sampler.readings.filter((reading) => reading.at >= loadStart);
  const streamPeak = stream.reduce((most, reading) => Math.max(most, reading.inFlight), 0);

  const { readings } = sampler;
  const loopLagMax = readings.reduce((most, reading) => Math.max(most, reading.loopLagMax || 0), 0);
  const upstreamSeconds = (upstreamAfter.cpuMicros - upstreamBefore.cpuMicros) / 1e6;
  const calls = upstreamAfter.received - upstreamBefore.received;
  const backlogCalls = upstreamAfterBacklog.received;

  const count = (value: number) => value.toLocaleString('en-US');
  const ratioText = Number.isFinite(ratio) ? ratio.toFixed(2) : 'n/a';
  const perTenThousand = Number.isFinite(extraPer10k) ? mb(extraPer10k) : 'n/a';
  const delay = `${upstreamDelayMs / 1000} s`;
  const details = [
    `--role api + --role worker, UPSTREAM_BASE_URL a loopback upstream in a process of its own answering every call after ${count(upstreamDelayMs)} ms ` +
      `(UPSTREAM_TIMEOUT_MS=${settings.UPSTREAM_TIMEOUT_MS}); twice ${count(slowRequests)} signed wait=false requests of a live key, ` +
      `${connections} connections, closed loop; the worker's gauge of calls in flight (gateway_upstream_calls_in_flight{mode="live"}) and ` +
      `resident memory read every ${SAMPLE_MS} ms (${count(readings.length)} readings of its /metrics, answered in p50 ${ms(sampler.latency.percentile(50))}, ` +
      `max ${ms(sampler.latency.max)})`,
    `backlog (model ${BACKLOG_MODEL}, answered after ${count(BACKLOG_DELAY_MS)} ms): ${count(backlogRows.stored)} stored while their lane was paused, then let go: ` +
      `peak ${count(peak)} calls in flight in the worker` +
      (atPeak ? ` ${seconds((atPeak.at - releasedAt) / 1000)} after` : '') +
      `, the upstream saw ${count(upstreamAfterBacklog.peakInFlight)} at once on ${count(upstreamAfterBacklog.peakConnections)} connections at most; ` +
      `all ${count(backlogRows.completed)} completed ${seconds(drainedMs / 1000)} after the lane was let go` +
      (backlogComplete ? '' : `  ** ${count(backlogRows.completed)} of ${count(slowRequests)} completed, ${count(backlogRows.failed)} failed **`),
    `backlog: worker resident memory ${mb(rssBefore)} before any load, ${atPeak ? mb(atPeak.rss) : 'n/a'} at the peak's reading, ` +
      `${mb(rssNearPeak)} at the highest of the ${nearPeak.length} readings with ${Math.round(NEAR_PEAK * 100)}% of the peak or more in flight: ` +
      `${mb(rssNearPeak - rssBefore)} for ${count(peak)} calls, ${perTenThousand} per 10,000` +
      (peak > 0 && peak < 10_000 ? ` (scaled from ${count(peak)})` : '') +
      `; its V8 heap in use (garbage not yet collected included): ${Number.isFinite(heapBefore) ? mb(heapBefore) : 'n/a'} before, ` +
      `${heapNearPeak.length > 0 ? `${mb(Math.min(...heapNearPeak))} to ${mb(Math.max(...heapNearPeak))}` : 'n/a'} in those readings; ` +
      (leanest
        ? `the least heap in use per call with half the peak or more in flight: ${(leanest.perCall / 1024).toFixed(1)} KB ` +
          `(${mb(leanest.reading.heapUsed)} at ${count(leanest.reading.inFlight)} calls)`
        : 'no heap readings near the peak') +
      `; once all had finished: resident ${afterBacklog ? mb(afterBacklog.rss) : 'n/a'}, heap in use ${afterBacklog ? mb(afterBacklog.heapUsed) : 'n/a'}`,
    `stream (model ${MODEL}): accepted ${count(rows.stored)} in ${seconds(rows.acceptSeconds)} (first to last created_at): ${rate(acceptRate)}/s; ` +
      `completed ${count(rows.completed)} in ${seconds(rows.completeSeconds)} (first to last finished_at): ${rate(completionRate)}/s, ` +
      `${ratioText} of the accept rate; end to end ${seconds(rows.endToEndSeconds)} (first created_at to last finished_at): ${rate(endToEndRate)}/s`,
    `stream: stored to finished: min ${seconds(rows.latency.min)}, p50 ${seconds(rows.latency.p50)}, p99 ${seconds(rows.latency.p99)}, max ${seconds(rows.latency.max)} ` +
      `(the upstream's ${delay} included); the load generator submitted for ${seconds(submitMs / 1000)}, all were finished ${seconds(settleMs / 1000)} later` +
      (settled ? '' : `  ** not all within ${SETTLE_TIMEOUT_MS / 1000} s **`) +
      `; at most ${count(streamPeak)} calls in flight in the worker`,
    `the worker's event loop was held up ${ms(loopLagMax * 1000)} at the longest (nodejs_eventloop_lag_max_seconds of the readings)`,
    `stream: ${cpuLine(cpu, rows.completed / cpu.seconds)}`,
    `stream: ${cpuPerRequest(cpu, workerCpu, rows.completed, upstreamSeconds, calls)}`,
  ];
  for (const [part, figures] of [
    ['backlog', backlogRows],
    ['stream', rows],
  ] as const) {
    if (figures.failed > 0) details.push(`** ${part}: ${count(figures.failed)} requests failed: ${figures.failures} **`);
    if (figures.unfinished > 0) details.push(`** ${part}: ${count(figures.unfinished)} requests were not finished when the benchmark stopped waiting: ${figures.unfinishedByStatus} **`);
  }
  for (const [part, submitted, figures] of [
    ['backlog', backlogLoad, backlogRows],
    ['stream', load, rows],
  ] as const) {
    if (figures.stored !== submitted.totalOk) {
      details.push(`** ${part}: ${count(submitted.totalOk)} acknowledged but ${count(figures.stored)} stored: every acknowledgement should be one request **`);
    }
    const errors = errorLine(submitted);
    if (errors) details.push(`${part}: ${errors}`);
  }
  if (calls + backlogCalls !== rows.completed + rows.failed + backlogRows.completed + backlogRows.failed) {
    details.push(
      `** the upstream received ${count(calls + backlogCalls)} calls for ${count(rows.completed + rows.failed + backlogRows.completed + backlogRows.failed)} finished requests: some were retried or lost **`,
    );
  }
  const upstreamErrors = Object.entries(upstreamAfter.errors);
  if (upstreamAfter.abandoned > 0 || upstreamErrors.length > 0) {
    details.push(
      `** the upstream: ${count(upstreamAfter.abandoned)} calls abandoned by the worker before their answer` +
        (upstreamErrors.length > 0 ? `; ${upstreamErrors.map(([kind, n]) => `${kind} ×${n}`).join(', ')}` : '') +
        ' **',
    );
  }
  if (sampler.failures.size > 0) {
    details.push(`** readings of the worker's /metrics failed: ${[...sampler.failures].map(([kind, n]) => `${kind} ×${n}`).join(', ')} **`);
  }

  const shortfall = complete ? '' : `; ${count(rows.completed)} of ${count(slowRequests)} completed`;
  return {
    rows: [
      {
        figure: `slow upstream (${delay}): completions/s and ratio to accept`,
        result: `${rate(completionRate)} completions/s; ${ratioText} × accept (${rate(acceptRate)}/s)${shortfall}`,
        target: `ratio ≥ ${SLOW_RATIO_TARGET}`,
        met: ratio >= SLOW_RATIO_TARGET && complete,
      },
      {
        figure: 'slow upstream: peak calls in flight (one worker)',
        result: `${count(peak)} (the upstream saw ${count(upstreamAfterBacklog.peakInFlight)} at once)`,
        target: '≥ 10,000',
        met: peak >= 10_000 && backlogComplete,
      },
      {
        figure: 'slow upstream: extra memory per 10,000 in flight',
        result: `${perTenThousand} (${mb(rssBefore)} → ${mb(rssNearPeak)} at ${count(peak)})`,
        target: `≤ ${mb(SLOW_MEMORY_TARGET_BYTES)}`,
        met: extraPer10k <= SLOW_MEMORY_TARGET_BYTES && backlogComplete,
      },
    ],
    details,
    data: {
      requests: slowRequests,
      upstreamDelayMs,
      acceptedPerSecond: acceptRate,
      completionsPerSecond: completionRate,
      ratio,
      endToEndPerSecond: endToEndRate,
      stored: rows.stored,
      acknowledged: load.totalOk,
      completed: rows.completed,
      failed: rows.failed,
      unfinished: rows.unfinished,
      acceptSeconds: rows.acceptSeconds,
      completeSeconds: rows.completeSeconds,
      endToEndSeconds: rows.endToEndSeconds,
      storedToFinishedSeconds: rows.latency,
      submitMs,
      settleMs,
      backlog: { ...backlogRows, drainedMs, peakInFlight: peak, upstreamPeakInFlight: upstreamAfterBacklog.peakInFlight },
      peakInFlight: peak,
      streamPeakInFlight: streamPeak,
      upstream: { before: upstreamBefore, after: upstreamAfter },
      rssBefore,
      rssNearPeak,
      extraBytesPer10k: extraPer10k,
      // Each reading: milliseconds since the backlog was let go, calls in flight, resident MB,
      // heap used MB, and the longest event loop delay since the last reading in ms.
      readings: readings.map((reading) => [
        Math.round(reading.at - releasedAt),
        reading.inFlight,
        Math.round((reading.rss / 1024 / 1024) * 10) / 10,
        Math.round((reading.heapUsed / 1024 / 1024) * 10) / 10,
        Math.round(reading.loopLagMax * 1000),
      ]),
      loopLagMaxMs: loopLagMax * 1000,
      errors: Object.fromEntries(load.errors),
      cpu: cpu.cores,
      workerCores: workerCpu.cores.gateway,
      upstreamCpuSeconds: upstreamSeconds,
    },
  };
}

interface Reading {
  /** performance.now() when the gauge's answer arrived. */
  at: number;
  inFlight: number;
  rss: number;
  heapUsed: number;
  /** Seconds. */
  loopLagMax: number;
}

interface Sampler {
  readings: Reading[];
  /** How long each /metrics took to answer (the worker's event loop is busy too). */
  latency: Samples;
  failures: Map<string, number>;
  stop(): Promise<void>;
}

/**
 * Reads the worker's gauge of live calls in flight (its /metrics, on a keep-alive connection)
 * and its resident memory every SAMPLE_MS, until stop() or the worker's exit (a phase that
 * failed half-way stops its processes and so its sampler).
 */
function sampleWorker(worker: GatewayProcess, metricsToken: string): Sampler {
  const readings: Reading[] = [];
  const latency = new Samples();
  const failures = new Map<string, number>();
  const request = `GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:${worker.port}\r\nAuthorization: Bearer ${metricsToken}\r\n\r\n`;
  let sampling = true;
  const loop = (async () => {
    let connection: HttpConnection | undefined;
    while (sampling && worker.exitCode === undefined) {
      const started = performance.now();
      try {
        connection ??= await HttpConnection.connect(worker.port);
        const response = await connection.send(request);
        const text = response.body.toString('latin1');
        const match = IN_FLIGHT.exec(text);
        if (response.status !== 200) increment(failures, `HTTP ${response.status}`);
        else if (!match) increment(failures, 'no gateway_upstream_calls_in_flight{mode="live"} in the answer');
        else {
          latency.add(response.receivedAt - response.sentAt);
          readings.push({
            at: response.receivedAt,
            inFlight: Number(match[1]),
            rss: residentBytesOf(worker.pid),
            heapUsed: Number(HEAP_USED.exec(text)?.[1] ?? Number.NaN),
            loopLagMax: Number(LOOP_LAG_MAX.exec(text)?.[1] ?? Number.NaN),
          });
        }
      } catch (error) {
        increment(failures, (error as Error).message);
        connection?.close();
        connection = undefined;
      }
      if (connection?.closed) connection = undefined;
      await sleep(Math.max(0, SAMPLE_MS - (performance.now() - started)));
    }
    connection?.close();
  })();
  return {
    readings,
    latency,
    failures,
    stop: async () => {
      sampling = false;
      await loop;
    },
  };
}

interface StoredFigures {
  stored: number;
  completed: number;
  failed: number;
  unfinished: number;
  /** "upstream_timeout ×3, ..." */
  failures: string;
  unfinishedByStatus: string;
  acceptSeconds: number;
  completeSeconds: number;
  endToEndSeconds: number;
  latency: { min: number; p50: number; p99: number; max: number };
}

/** Counts and spans of the phase's requests of one model, all from the database's own timestamps. */
async function storedFigures(ctx: PhaseContext, model: string): Promise<StoredFigures> {
  return ctx.query(async (client) => {
    const { rows } = await client.query<{
      stored: string;
      completed: string;
      failed: string;
      unfinished: string;
      accept_seconds: number | null;
      complete_seconds: number | null;
      end_to_end_seconds: number | null;
      latency: number[] | null;
    }>(
      `select count(*) as stored,
              count(*) filter (where status = 'completed') as completed,
              count(*) filter (where status = 'failed') as failed,
              count(*) filter (where finished_at is null) as unfinished,
              extract(epoch from max(created_at) - min(created_at))::float8 as accept_seconds,
              extract(epoch from max(finished_at) - min(finished_at))::float8 as complete_seconds,
              extract(epoch from max(finished_at) - min(created_at))::float8 as end_to_end_seconds,
              percentile_cont(array[0, 0.5, 0.99, 1]) within group (order by extract(epoch from finished_at - created_at)::float8) as latency
       from gateway.requests where model = $1`,
      [model],
    );
    const row = rows[0]!;
    const byKind = async (sql: string) =>
      (await client.query<{ kind: string | null; count: string }>(sql)).rows.map((r) => `${r.kind ?? 'unknown'} ×${r.count}`).join(', ');
    const failed = Number(row.failed);
    const unfinished = Number(row.unfinished);
    const [min, p50, p99, max] = row.latency ?? [Number.NaN, Number.NaN, Number.NaN, Number.NaN];
    return {
      stored: Number(row.stored),
      completed: Number(row.completed),
      failed,
      unfinished,
      failures: failed > 0 ? await byKind(`select last_error_code as kind, count(*) from gateway.requests where status = 'failed' and model = '${model}' group by 1 order by 2 desc`) : '',
      unfinishedByStatus:
        unfinished > 0 ? await byKind(`select status as kind, count(*) from gateway.requests where finished_at is null and model = '${model}' group by 1 order by 2 desc`) : '',
      acceptSeconds: row.accept_seconds ?? Number.NaN,
      completeSeconds: row.complete_seconds ?? Number.NaN,
      endToEndSeconds: row.end_to_end_seconds ?? Number.NaN,
      latency: { min: min!, p50: p50!, p99: p99!, max: max! },
    };
  });
}

/** CPU per completed request of the worker and the API, and per call of the upstream. */
function cpuPerRequest(all: CpuShares, workerOnly: CpuShares, completed: number, upstreamSeconds: number, calls: number): string {
  const micros = (cpuSeconds: number, per: number) => (per > 0 ? `${Math.round((cpuSeconds / per) * 1e6).toLocaleString('en-US')} µs` : 'n/a');
  const workerSeconds = workerOnly.cores.gateway * workerOnly.seconds;
  const apiSeconds = Math.max(0, all.cores.gateway * all.seconds - workerSeconds);
  return (
    `per completed request: worker ${micros(workerSeconds, completed)}, API ${micros(apiSeconds, completed)} of CPU; ` +
    `the upstream ${micros(upstreamSeconds, calls)} per call (${(upstreamSeconds / all.seconds).toFixed(2)} cores, counted above in the load generator's share)`
  );
}

function seconds(value: number): string {
  if (!Number.isFinite(value)) return 'n/a';
  return value >= 10 ? `${value.toFixed(1)} s` : `${value.toFixed(2)} s`;
}
