// End-to-end throughput: requests per second the whole gateway (API and worker, as deployed by
// BENCH_TOPOLOGY) takes from submission to `completed`, sustained. Connections submit
// wait=false requests as fast as they are answered, but only while the queue (the requests not
// finished yet: queued, processing or retrying) is shorter than BACKLOG; above it they pause.
// So the system runs at whichever of accepting and processing is slower, with a healthy
// queue, as it could for hours: a queue growing without bound would measure an overload instead. The figure is the number of requests whose
// finished_at falls in the window, divided by its length, both from the database's clock.
import { setTimeout as sleep } from 'node:timers/promises';
import { cpuLine, type PhaseContext, type PhaseResult } from '../context.ts';
import { checks, closedLoop } from '../load.ts';
import { withClient } from '../postgres.ts';
import { sha256Hex } from '../signing.ts';
import { COMPLETIONS, completionBody, errorLine, rate } from './common.ts';

export const END_TO_END_TARGET = 2_000;
/** Unfinished requests above which submissions pause: enough that the worker never runs dry
 * between two polls, few enough to be reached within the warm-up. */
const BACKLOG = 256;
const POLL_MS = 50;

export async function endToEndPhase(ctx: PhaseContext): Promise<PhaseResult> {
  const { connections, warmupMs, durationMs, topology } = ctx.settings;
  await ctx.start(topology);
  const api = ctx.api();
  const signer = ctx.signer(api.port!);
  const body = completionBody({ wait: false });
  const bodySha256 = sha256Hex(body);

  return withClient(ctx.databaseUrl, async (monitor) => {
    // The queue's length, read every POLL_MS; submissions wait while it is at BACKLOG or more.
    let backlog = 0;
    let resume: { promise: Promise<void>; resolve(): void } | undefined;
    let polling = true;
    let counting = false;
    const observed = { polls: 0, pausedPolls: 0, backlogSum: 0 };
    const poller = (async () => {
      while (polling) {
        const { rows } = await monitor.query<{ count: string }>(
          `select count(*) from (select from gateway.requests where finished_at is null limit ${2 * BACKLOG}) as unfinished`,
        );
        backlog = Number(rows[0]!.count);
        if (backlog < BACKLOG && resume) {
          resume.resolve();
          resume = undefined;
        }
        if (counting) {
          observed.polls++;
          observed.backlogSum += backlog;
          if (backlog >= BACKLOG) observed.pausedPolls++;
        }
        await sleep(POLL_MS);
      }
      resume?.resolve();
    })();
    // When the run is over, nothing is held back any more (the connections then stop).
    let over = false;
    const overTimer = setTimeout(() => {
      over = true;
      resume?.resolve();
    }, warmupMs + durationMs);
    const gate = () => {
      if (over || backlog < BACKLOG) return undefined;
      resume ??= Promise.withResolvers<void>();
      return resume.promise;
    };

    const databaseNow = async () => (await monitor.query<{ now: Date }>('select clock_timestamp() as now')).rows[0]!.now;
    let windowStart: Promise<Date> | undefined;
    let windowEnd: Promise<Date> | undefined;
    const cpuWindow = ctx.cpuWindow();
    const result = await closedLoop({
      port: api.port!,
      connections,
      warmupMs,
      durationMs,
      gate,
      request: () => signer.post(COMPLETIONS, body, bodySha256),
      check: checks.status(202, '"object":"chat.completion.async"'),
      onWindowStart: () => {
        windowStart = databaseNow();
        counting = true;
        cpuWindow.onWindowStart();
      },
      onWindowEnd: () => {
        windowEnd = databaseNow();
        counting = false;
        cpuWindow.onWindowEnd();
      },
    });
    clearTimeout(overTimer);
    polling = false;
    await poller;
    const cpu = await cpuWindow.shares();
    const from = await windowStart!;
    const to = await windowEnd!;

    const { rows } = await monitor.query<{ completed: string; failed: string }>(
      `select count(*) filter (where status = 'completed') as completed,
              count(*) filter (where status = 'failed') as failed
       from gateway.requests where finished_at >= $1 and finished_at < $2`,
      [from, to],
    );
    const completed = Number(rows[0]!.completed);
    const failed = Number(rows[0]!.failed);
    const seconds = (to.getTime() - from.getTime()) / 1000;
    const completionsPerSecond = completed / seconds;
    const submitted = result.ok / (durationMs / 1000);
    const paused = observed.polls > 0 ? observed.pausedPolls / observed.polls : 0;
    const averageBacklog = observed.polls > 0 ? observed.backlogSum / observed.polls : 0;

    const details = [
      `${topology.map((role) => `--role ${role}`).join(' + ')}; ${connections} connections submit wait=false (model test-echo), ` +
        `pausing while ${BACKLOG.toLocaleString('en-US')} or more requests are unfinished; ` +
        `rate = requests whose finished_at is in the ${durationMs / 1000} s window / its length`,
      `in the window: ${rate(submitted)} accepted/s, ${rate(completionsPerSecond)} completed/s; queue ${Math.round(averageBacklog).toLocaleString('en-US')} requests on average; ` +
        `submissions paused ${(paused * 100).toFixed(0)}% of the time ` +
        (paused > 0.5 ? '(processing is the limit)' : paused < 0.05 ? '(accepting is the limit)' : '(both are close)'),
      cpu ? cpuLine(cpu, completionsPerSecond) : 'CPU: not measured',
    ];
    if (Math.abs(submitted - completionsPerSecond) > 0.1 * Math.max(submitted, completionsPerSecond)) {
      details.push('** accepted and completed rates differ by more than 10%: not yet a steady state (a longer BENCH_WARMUP helps) **');
    }
    if (failed > 0) details.push(`** ${failed} requests failed in the window **`);
    const errors = errorLine(result);
    if (errors) details.push(errors);

    return {
      rows: [
        {
          figure: `end-to-end, submitted to completed (${topology.join('+')})`,
          result: `${rate(completionsPerSecond)} completions/s`,
          target: `≥ ${END_TO_END_TARGET.toLocaleString('en-US')} /s`,
          met: completionsPerSecond >= END_TO_END_TARGET && failed === 0 && result.errors.size === 0,
        },
      ],
      details,
      data: {
        completionsPerSecond,
        acceptedPerSecond: submitted,
        completed,
        failed,
        seconds,
        averageBacklog,
        pausedShare: paused,
        errors: Object.fromEntries(result.errors),
        cpu: cpu?.cores,
      },
    };
  });
}
