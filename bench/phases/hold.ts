// 10,000 wait=true requests held open at once. An API process (no worker, so nothing can
// complete early) takes them in, each on its own connection with its own message; once all
// are stored, and so all waiting, the API process's resident memory and the database's
// connections are read. Then a worker process is started: every request must come back 200
// with the completion that echoes its own message (the waiters are woken across processes,
// by the database's notifications).
import { setTimeout as sleep } from 'node:timers/promises';
import { cpuLine, type PhaseContext, type PhaseResult } from '../context.ts';
import { HttpConnection, type HttpResponse } from '../http.ts';
import { checks, closedLoop } from '../load.ts';
import { connectionsOf, withClient, type Connections } from '../postgres.ts';
import { sha256Hex } from '../signing.ts';
import { increment } from '../stats.ts';
import { COMPLETIONS, completionBody, mb } from './common.ts';

export const HOLD_TARGET_BYTES = 150 * 1024 * 1024;
const SETTINGS = { WAIT_TIMEOUT_MS: '600000' };
// Requests sent but not yet stored: enough to keep the API busy, few enough that none waits
// long for a database connection while the rest are taken in.
const UNSTORED_WINDOW = 256;
const RAMP_TIMEOUT_MS = 240_000;
const RELEASE_TIMEOUT_MS = 300_000;
const HOLD_SAMPLING_MS = 2_000;

export async function holdPhase(ctx: PhaseContext): Promise<PhaseResult> {
  const { hold } = ctx.settings;
  const [api] = await ctx.start(['api'], SETTINGS);
  const port = api!.port!;
  const signer = ctx.signer(port);
  const details: string[] = [
    `--role api with WAIT_TIMEOUT_MS=${SETTINGS.WAIT_TIMEOUT_MS} holds them (no worker yet); then a --role worker process completes them`,
  ];

  // Warm the API up (code paths compiled, pools filled) before its memory is read.
  const warmBody = completionBody({ wait: false });
  const warmSha = sha256Hex(warmBody);
  await closedLoop({
    port,
    connections: 16,
    warmupMs: 0,
    durationMs: 2_000,
    request: () => signer.post(COMPLETIONS, warmBody, warmSha),
    check: checks.status(202),
  });
  await sleep(1_000);

  return withClient(ctx.databaseUrl, async (monitor) => {
    const countRequests = async () =>
      Number((await monitor.query<{ count: string }>('select count(*) from gateway.requests')).rows[0]!.count);
    const warmRows = await countRequests();
    const rssBefore = api!.residentBytes();
    const connectionsBefore = await connectionsOf(monitor, ctx.database);

    const meter = ctx.cpuMeter();
    const outcomes: Promise<Outcome>[] = [];
    let sent = 0;
    let stored = 0;
    // Answered before the worker runs: these cannot be correct (nothing completed yet).
    let answered = 0;
    let rssPeak = rssBefore;
    let peakConnections: Connections = connectionsBefore;
    const sample = async () => {
      rssPeak = Math.max(rssPeak, api!.residentBytes());
      const connections = await connectionsOf(monitor, ctx.database);
      if (connections.total > peakConnections.total) peakConnections = connections;
      return connections;
    };

    // Ramp: keep at most UNSTORED_WINDOW requests sent but neither stored nor answered.
    const rampStart = performance.now();
    while (performance.now() - rampStart < RAMP_TIMEOUT_MS) {
      const room = Math.min(hold - sent, UNSTORED_WINDOW - (sent - stored - answered));
      for (let i = 0; i < room; i++) {
        outcomes.push(holdOne(port, signer, sent++, ctx.run.runId).finally(() => answered++));
      }
      await sleep(100);
      stored = (await countRequests()) - warmRows;
      await sample();
      if (api!.exitCode !== undefined || (sent === hold && stored + answered >= hold)) break;
    }
    const rampMs = performance.now() - rampStart;
    const settledEarly = answered;

    // All held: read memory and connections for a moment.
    let rssHeld = 0;
    let heldConnections: Connections = await sample();
    for (const end = performance.now() + HOLD_SAMPLING_MS; performance.now() < end; ) {
      await sleep(250);
      rssHeld = Math.max(rssHeld, api!.residentBytes());
      const connections = await sample();
      if (connections.total >= heldConnections.total) heldConnections = connections;
    }

    // Release: a worker completes them all; each waiter must get its own completion.
    const releaseStart = performance.now();
    await ctx.start(['worker'], SETTINGS);
    const all = Promise.all(outcomes);
    const done = await Promise.race([all.then(() => true), sleep(RELEASE_TIMEOUT_MS, false, { ref: false })]);
    const releaseMs = performance.now() - releaseStart;
    const cpu = await meter.end();
    const results = done ? await all : await settledSoFar(outcomes);
    const kinds = new Map<string, number>();
    let correct = 0;
    for (const outcome of results) {
      if (outcome === 'correct') correct++;
      else increment(kinds, outcome);
    }
    if (sent > results.length) increment(kinds, 'still unanswered when the benchmark gave up', sent - results.length);
    if (hold > sent) increment(kinds, 'never sent (the ramp timed out)', hold - sent);

    const extra = rssHeld - rssBefore;
    const listeningPerApi = heldConnections.listening;
    details.push(
      `ramp: ${stored.toLocaleString('en-US')} of ${hold.toLocaleString('en-US')} stored and waiting after ${(rampMs / 1000).toFixed(1)} s ` +
        `(at most ${UNSTORED_WINDOW} sent but not yet stored at a time)` +
        (settledEarly > 0 ? `; ** ${settledEarly} were answered before the worker started **` : ''),
      `API process resident memory: ${mb(rssBefore)} before, ${mb(rssHeld)} while all were held (highest of ${HOLD_SAMPLING_MS / 1000} s of samples), ${mb(rssPeak)} at the highest`,
      `Postgres connections while held: ${describeConnections(heldConnections)}; before: ${describeConnections(connectionsBefore)}; ` +
        `most at once during the ramp: ${peakConnections.total}`,
      `release: all answered ${(releaseMs / 1000).toFixed(1)} s after the worker was started` + (done ? '' : ` ** not within ${RELEASE_TIMEOUT_MS / 1000} s **`),
      cpuLine(cpu),
    );
    if (kinds.size > 0) {
      details.push(`** wrong answers: ${[...kinds].map(([kind, count]) => `${kind} ×${count}`).join(', ')} **`);
    }

    const heldLabel = hold.toLocaleString('en-US');
    return {
      rows: [
        {
          figure: `${heldLabel} wait=true held: extra memory of the API process`,
          result: `${mb(extra)} (${mb(rssBefore)} → ${mb(rssHeld)})`,
          target: `≤ ${mb(HOLD_TARGET_BYTES)}`,
          met: extra <= HOLD_TARGET_BYTES && stored >= hold,
        },
        {
          figure: `${heldLabel} wait=true held: Postgres connections`,
          result: `${heldConnections.total}, of which ${listeningPerApi} LISTEN`,
          target: 'one LISTEN connection per process',
          met: listeningPerApi === 1,
        },
        {
          figure: `${heldLabel} wait=true held: answered correctly`,
          result: `${correct.toLocaleString('en-US')} / ${heldLabel}`,
          target: 'all',
          met: correct === hold,
        },
      ],
      details,
      data: {
        hold,
        stored,
        rampMs,
        rssBefore,
        rssHeld,
        rssPeak,
        extraBytes: extra,
        connectionsHeld: heldConnections,
        connectionsPeak: peakConnections,
        releaseMs,
        correct,
        wrong: Object.fromEntries(kinds),
        cpu: cpu.cores,
      },
    };
  });
}

type Outcome = 'correct' | string;

/** One held request on a connection of its own, answered with a check of its content. */
async function holdOne(port: number, signer: ReturnType<PhaseContext['signer']>, index: number, runId: string): Promise<Outcome> {
  const content = `held request ${index} of ${runId}`;
  const body = completionBody({ wait: true, content });
  let connection: HttpConnection | undefined;
  try {
    connection = await HttpConnection.connect(port);
    const response = await connection.send(signer.post(COMPLETIONS, body, sha256Hex(body)));
    return judge(response, content);
  } catch (error) {
    return `request failed: ${(error as Error).message}`;
  } finally {
    connection?.close();
  }
}

function judge(response: HttpResponse, content: string): Outcome {
  let parsed: { object?: string; status?: string; error?: { code?: string }; choices?: { message?: { content?: string } }[] };
  try {
    parsed = JSON.parse(response.body.toString('utf8'));
  } catch {
    return `HTTP ${response.status} with a body that is not JSON`;
  }
  if (response.status !== 200) {
    return `HTTP ${response.status} ${parsed.error?.code ?? `${parsed.object ?? ''} ${parsed.status ?? ''}`.trim()}`;
  }
  if (parsed.object !== 'chat.completion') return `HTTP 200 with object ${parsed.object}`;
  if (parsed.choices?.[0]?.message?.content !== content) return 'HTTP 200 with the completion of another request';
  return 'correct';
}

/** The outcomes that are known now (the rest are still waiting). */
async function settledSoFar(outcomes: Promise<Outcome>[]): Promise<Outcome[]> {
  const pending = Symbol('pending');
  const states = await Promise.all(outcomes.map((outcome) => Promise.race([outcome, Promise.resolve(pending)])));
  return states.filter((state): state is Outcome => state !== pending);
}

function describeConnections(connections: Connections): string {
  const parts = Object.entries(connections.byApplication).map(([name, count]) => `${count} ${name}`);
  return `${connections.total} (${parts.join(', ') || 'none'}; ${connections.listening} LISTEN)`;
}

