// The slow-upstream phase's upstream, run as a process of its own (bench/upstream.ts starts it):
// an OpenAI-compatible server on loopback that answers every POST /v1/chat/completions after a
// fixed delay (argv[2], in ms; a model named ...-<n>ms asks for n ms instead) with a chat
// completion, as a provider answers a long generation.
// Each call in flight holds one of its sockets for the whole delay, 10,000 and more at once: in
// a process of its own, they count against its open-file limit, and its CPU and event loop are
// neither the load generator's nor the gateway's.
//
// Started with an IPC channel: it sends { kind: 'listening', port } once listening, answers
// { kind: 'stats' } with its counts, and exits when the channel closes (the benchmark ended).
import http from 'node:http';

export interface UpstreamStats {
  /** Calls whose request arrived complete. */
  received: number;
  /** Calls answered with their completion (the response's last byte handed to the kernel). */
  answered: number;
  /** Calls whose client went away before the answer. */
  abandoned: number;
  /** Requests for anything but POST /v1/chat/completions (answered 404). */
  refused: number;
  inFlight: number;
  /** The most calls received and not yet answered or abandoned at once. */
  peakInFlight: number;
  /** Connections open now, and the most at once. */
  connections: number;
  peakConnections: number;
  /** This process's CPU time (user and system) since it started, and its resident memory now. */
  cpuMicros: number;
  residentBytes: number;
  /** Server and client errors (EMFILE on accept, malformed requests), by message. */
  errors: Record<string, number>;
}

export type UpstreamMessage = { kind: 'listening'; port: number } | { kind: 'stats'; stats: UpstreamStats };

const delayMs = Number(process.argv[2]);
// A caller's keep-alive connection stays open between calls; requests and their headers have
// far longer than the delay to arrive (a busy machine delays the writes).
const PATIENCE_MS = Math.max(60_000, delayMs + 60_000);

function serve(): void {
  if (!Number.isSafeInteger(delayMs) || delayMs < 0 || !process.send) {
    console.error('usage: node bench/slow-upstream.ts <delay ms>, started with an IPC channel (bench/upstream.ts)');
    process.exit(2);
  }
  const stats: UpstreamStats = {
    received: 0,
    answered: 0,
    abandoned: 0,
    refused: 0,
    inFlight: 0,
    peakInFlight: 0,
    connections: 0,
    peakConnections: 0,
    cpuMicros: 0,
    residentBytes: 0,
    errors: {},
  };
  const error = (message: string) => (stats.errors[message] = (stats.errors[message] ?? 0) + 1);
  let next = 0;

  const server = http.createServer(
    { keepAliveTimeout: PATIENCE_MS, headersTimeout: PATIENCE_MS, requestTimeout: 2 * PATIENCE_MS },
    (request, response) => {
      if (request.method !== 'POST' || request.url !== '/v1/chat/completions') {
        stats.refused++;
        request.resume();
        response.writeHead(404, { 'content-length': '0' }).end();
        return;
      }
      const chunks: Buffer[] = [];
      request.on('data', (chunk: Buffer) => chunks.push(chunk));
      request.on('end', () => {
        stats.received++;
        stats.inFlight++;
        stats.peakInFlight = Math.max(stats.peakInFlight, stats.inFlight);
        const asked = parse(Buffer.concat(chunks).toString('utf8'));
        const delay = Number(/-(\d{1,7})ms$/.exec(asked.model)?.[1] ?? delayMs);
        const timer = setTimeout(() => {
          const body = completion(asked, delay, next++);
          response.writeHead(200, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) });
          response.end(body);
        }, delay);
        response.once('finish', () => stats.answered++);
        response.once('close', () => {
          clearTimeout(timer);
          stats.inFlight--;
          if (!response.writableFinished) stats.abandoned++;
        });
      });
    },
  );
  server.on('connection', (socket) => {
    stats.connections++;
    stats.peakConnections = Math.max(stats.peakConnections, stats.connections);
    socket.once('close', () => stats.connections--);
  });
  server.on('clientError', (failure: Error & { code?: string }, socket) => {
    error(`client error: ${failure.code ?? failure.message}`);
    socket.destroy();
  });

  process.on('message', (message: { kind?: string }) => {
    if (message.kind !== 'stats') return;
    const cpu = process.cpuUsage();
    stats.cpuMicros = cpu.user + cpu.system;
    stats.residentBytes = process.memoryUsage.rss();
    process.send!({ kind: 'stats', stats } satisfies UpstreamMessage);
  });
  process.on('disconnect', () => process.exit(0));

  server.once('error', (failure) => {
    console.error(`the slow upstream could not listen: ${failure.message}`);
    process.exit(1);
  });
  // A dispatch starts hundreds of calls at once, each on a new connection: a short accept queue
  // would drop their SYNs, and each dropped one costs a second's retransmission.
  server.listen({ port: 0, host: '127.0.0.1', backlog: 4096 }, () => {
    server.removeAllListeners('error');
    // Accept failures (EMFILE above the open-file limit) are counted, not fatal.
    server.on('error', (failure: Error & { code?: string }) => error(`server error: ${failure.code ?? failure.message}`));
    process.send!({ kind: 'listening', port: (server.address() as { port: number }).port } satisfies UpstreamMessage);
  });
}

interface Asked {
  model: string;
  content: string;
  /** Length of the request's body, for a rough usage (4 characters a token). */
  length: number;
}

function parse(requestBody: string): Asked {
  try {
    const parsed = JSON.parse(requestBody) as { model?: string; messages?: { content?: string }[] };
    return { model: parsed.model ?? 'unknown', content: parsed.messages?.at(-1)?.content ?? '', length: requestBody.length };
  } catch {
    // Answered all the same: the gateway, not this server, is under test.
    return { model: 'unknown', content: '', length: requestBody.length };
  }
}

/** The answer to one request: its last message echoed, with a rough usage. */
function completion(asked: Asked, delay: number, index: number): string {
  const answer = `After ${delay} ms: ${asked.content}`;
  const promptTokens = Math.ceil(asked.length / 4);
  const completionTokens = Math.ceil(answer.length / 4);
  return JSON.stringify({
    id: `chatcmpl-bench${process.pid}x${index}`,
    object: 'chat.completion',
    created: Math.floor(Date.now() / 1000),
    model: asked.model,
    choices: [{ index: 0, message: { role: 'assistant', content: answer }, finish_reason: 'stop' }],
    usage: { prompt_tokens: promptTokens, completion_tokens: completionTokens, total_tokens: promptTokens + completionTokens },
  });
}

serve();
