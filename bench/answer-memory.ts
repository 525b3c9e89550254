// The worker's memory while many large upstream answers arrive at once, with and without the
// budget of UPSTREAM_ANSWER_MEMORY_MB: the gateway's own upstream client (src/upstream/openai.ts)
// makes CALLS calls to a loopback upstream, in a process of its own, that answers them all
// together, each with ANSWER_BYTES of chat completion and no content-length. Prints, per budget,
// the calls that completed, how long they took, and the process's peak resident memory over its
// reading before them.
//
//   node bench/answer-memory.ts [CALLS] [ANSWER_BYTES] [BUDGET_MB ...]
//   node bench/answer-memory.ts 4000 2000000 256 100000     # the figures in BENCHMARKS.md
//
// Each budget runs in a child process of its own, so that one's garbage is not in the next's
// figure. The open-file limit must be above CALLS.
import { fork } from 'node:child_process';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { fileURLToPath } from 'node:url';
import { UpstreamClient } from '../src/upstream/openai.ts';

const MiB = 1024 * 1024;
const self = fileURLToPath(import.meta.url);
// A child is started with its role first (--upstream, --client), the others' arguments after it.
const [first, ...rest] = process.argv.slice(2);
const role = first?.startsWith('--') ? first.slice(2) : 'main';
const args = role === 'main' ? process.argv.slice(2) : rest;

/** Forks this file as `role` and resolves to the first message it sends. */
function child<T>(role: string, childArgs: string[]): { message: Promise<T>; kill: () => void } {
  const forked = fork(self, [`--${role}`, ...childArgs]);
  return { message: new Promise((resolve) => forked.once('message', (message) => resolve(message as T))), kill: () => forked.kill() };
}

if (role === 'upstream') {
  // Answers once every call is in, all at once.
  const [calls, answerBytes] = args.map(Number) as [number, number];
  const head = '{"id":"chatcmpl-bench","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"';
  const tail = '"},"finish_reason":"stop"}]}';
  const body = Buffer.from(head + 'x'.repeat(answerBytes - head.length - tail.length) + tail);
  const pending: http.ServerResponse[] = [];
  const server = http.createServer((request, response) => {
    request.resume();
    request.on('end', () => {
      pending.push(response);
      if (pending.length < calls) return;
      for (const answer of pending.splice(0)) {
        answer.writeHead(200, { 'content-type': 'application/json' });
        answer.end(body);
      }
    });
  });
  server.listen(0, '127.0.0.1', () => process.send!((server.address() as AddressInfo).port));
} else if (role === 'client') {
  const [calls, answerBytes, budgetMb] = args.map(Number) as [number, number, number];
  const upstream = child<number>('upstream', [String(calls), String(answerBytes)]);
  const port = await upstream.message;
  const client = new UpstreamClient({ maxResponseBytes: 2 * MiB, answerMemoryBytes: budgetMb * MiB });
  const base = process.memoryUsage().rss;
  let peak = base;
  const sampler = setInterval(() => (peak = Math.max(peak, process.memoryUsage().rss)), 20);
  const started = performance.now();
  const signal = AbortSignal.timeout(300_000);
  const target = { baseUrl: `http://127.0.0.1:${port}/v1`, apiKey: undefined };
  const completed = await Promise.all(
    Array.from({ length: calls }, () => client.call(target, { body: '{"model":"m","messages":[]}', signal }).then((outcome) => outcome.ok)),
  );
  clearInterval(sampler);
  process.send!({
    budgetMb,
    completed: completed.filter(Boolean).length,
    seconds: Math.round((performance.now() - started) / 100) / 10,
    peakExtraMb: Math.round((peak - base) / MiB),
  });
  await client.close();
  upstream.kill();
  process.disconnect();
} else {
  const [calls = 4000, answerBytes = 2_000_000, ...budgets] = args.map(Number);
  console.log(`${calls} calls answered together, ${answerBytes} bytes each, no content-length`);
  for (const budgetMb of budgets.length > 0 ? budgets : [256, 100_000]) {
    const run = child<Record<string, number>>('client', [String(calls), String(answerBytes), String(budgetMb)]);
    const result = await run.message;
    console.log(
      `UPSTREAM_ANSWER_MEMORY_MB=${budgetMb}: ${result.completed} of ${calls} completed in ${result.seconds} s; ` +
        `peak resident memory +${result.peakExtraMb} MB`,
    );
  }
}
