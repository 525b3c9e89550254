// What the command line prints: plain-text tables (what clients chose in them escaped, so that it
// cannot move the cursor, colour or forge rows), and errors the user can act on.

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

/** What a command runs with: the settings (the environment), and where its output goes. */
export interface CommandLineIo {
  env: Record<string, string | undefined>;
  /** Prints a text and a newline on standard output. */
  out(text: string): void;
  /** Prints a text and a newline on standard error. */
  err(text: string): void;
}
