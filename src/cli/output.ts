// What the command line prints: plain-text tables (what clients chose in them escaped, so that it
// cannot move the cursor, colour or forge rows), and errors the user can act on.
import { connectionFailure } from '../network-errors.ts';

export function table<Row extends object>(rows: readonly Row[], columns: readonly string[]): string {
  const cells = rows.map((row) => columns.map((column) => cell((row as Record<string, unknown>)[column])));
  const widths = columns.map((column, index) => Math.max(column.length, ...cells.map((line) => line[index]!.length)));
  const format = (line: string[]) => line.map((value, index) => value.padEnd(widths[index]!)).join('  ').trimEnd();
  return [format([...columns]), format(widths.map((width) => '-'.repeat(width))), ...cells.map(format)].join('\n');
}

function cell(value: unknown): string {
  if (value === null || value === undefined) return '';
  if (value instanceof Date) return value.toISOString();
  return printable(String(value));
}

// What a terminal acts on rather than shows: C0 and C1 controls (ESC begins colour and cursor
// sequences, CR and LF start forged rows, TAB shifts columns), DEL, the bidirectional marks,
// embeddings, overrides and isolates (which reorder what follows), and the line and paragraph
// separators.
const UNPRINTABLE = /[\u0000-\u001f\u007f-\u009f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]/g;

/**
 * The text with each character a terminal would act on written as an escape (`\x1b`, `\u202e`):
 * for what clients chose (model names, idempotency keys, error details), printed as text.
 */
export function printable(text: string): string {
  return text.replace(UNPRINTABLE, (character) => {
    const code = character.charCodeAt(0);
    return code <= 0xff ? `\\x${code.toString(16).padStart(2, '0')}` : `\\u${code.toString(16).padStart(4, '0')}`;
  });
}

/**
 * A failure the user can act on: printed without a stack, exit code 1. `output` is what the
 * command answers all the same (a summary of what it did do), printed on standard output before
 * the message goes to standard error, so that --json still prints its one JSON value.
 */
export class CommandError extends Error {
  override name = 'CommandError';
  readonly output: string | undefined;

  constructor(message: string, options: { output?: string | undefined } = {}) {
    super(message);
    this.output = options.output;
  }
}

/**
 * Why a connection could not be made, in one line: our words for its code when network-errors.ts
 * knows it, then the message of the innermost cause, which names the address (`connect
 * ECONNREFUSED 127.0.0.1:5432`), as fetch's own message says only "fetch failed".
 */
export function whyNotConnected(error: unknown): string {
  const failure = connectionFailure(error);
  const detail = innermostMessage(error) || failure.code || String(error);
  return failure.known ? `${failure.says} (${detail})` : detail;
}

/**
 * The message of the error's last cause; of the first of an AggregateError's errors when it has
 * none of its own (a host name whose every address refused).
 */
function innermostMessage(error: unknown, depth = 0): string {
  if (!(error instanceof Error) || depth > 5) return '';
  if (error.cause instanceof Error) return innermostMessage(error.cause, depth + 1);
  if (!error.message && error instanceof AggregateError) return innermostMessage(error.errors[0], depth + 1);
  return error.message;
}

/** What a command runs with: the settings (the environment), and where its output goes. */
export interface CommandLineIo {
  env: Record<string, string | undefined>;
  /** Prints a text and a newline on standard output. */
  out(text: string): void;
  /** Prints a text and a newline on standard error. */
  err(text: string): void;
}
