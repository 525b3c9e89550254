// JSON logs on stdout (pino). What is logged is chosen field by field at each call site:
// ids, statuses, codes and timings, never keys, signing secrets, headers or message content.
// The redaction list is a second line of defence for anything that slips through.
import { pino, type Logger } from 'pino';
import type { Config } from './config.ts';

export type { Logger };

export function createLogger(
  config: Pick<Config, 'logLevel'>,
  destination?: pino.DestinationStream,
): Logger {
  return pino(
    {
      level: config.logLevel,
      base: { service: 'gateway', pid: process.pid },
      timestamp: isoTimestamp(),
      formatters: { level: (label) => ({ level: label }) },
      redact: {
        paths: [
          'authorization',
          'headers.authorization',
          'headers["svc-signature"]',
          '*.authorization',
          'apiKey',
          'api_key',
          'signingSecret',
          'signing_secret',
          'upstreamApiKey',
        ],
        censor: '[redacted]',
      },
    },
    destination ?? standardOutput(),
  );
}

/**
 * pino's ISO timestamp (`,"time":"2026-11-27T09:00:00.000Z"`), its text made once per
 * millisecond: a busy process logs many lines in one, and formatting the date is a good part of
 * what a short line costs.
 */
function isoTimestamp(): () => string {
  let ms = Number.NaN;
  let text = '';
  return () => {
    const now = Date.now();
    if (now !== ms) {
      ms = now;
      text = `,"time":"${new Date(now).toISOString()}"`;
    }
    return text;
  };
}

/** Above this many characters, what a turn logged is written at once rather than at the turn's end. */
const TURN_CHARACTERS = 1 << 20;

/**
 * Standard output, written once per turn of the event loop: the lines logged in one turn go out
 * together at its end, in one write. A flood of refused requests logs dozens of lines a turn, and
 * each write is a system call that also wakes whatever reads the logs. The write is synchronous
 * and in order; nothing logged waits past the end of its turn (so a line is out before the
 * process next waits for anything), and what the last turn logged is written when the process
 * exits (process.exit, an uncaught exception; not when it is killed outright).
 */
export class TurnBatchedOutput implements pino.DestinationStream {
  readonly #out: pino.DestinationStream;
  #pending = '';
  #scheduled = false;

  constructor(out: pino.DestinationStream) {
    this.#out = out;
    process.on('exit', () => this.flush());
  }

  write(line: string): void {
    this.#pending += line;
    if (this.#pending.length >= TURN_CHARACTERS) this.flush();
    else if (!this.#scheduled) {
      this.#scheduled = true;
      setImmediate(() => this.flush());
    }
  }

  /** Writes what is pending now. */
  flush(): void {
    this.#scheduled = false;
    if (this.#pending === '') return;
    const text = this.#pending;
    this.#pending = '';
    this.#out.write(text);
  }
}

let stdout: TurnBatchedOutput | undefined;
/** The process's one standard output for logs, shared by every logger it creates. */
const standardOutput = () => (stdout ??= new TurnBatchedOutput(pino.destination({ dest: 1, sync: true })));
