// What the command line prints: plain-text tables, and errors the user can act on.

export function table<Row extends object>(rows: readonly Row[], columns: readonly string[]): string {
  const cells = rows.map((row) => columns.map((column) => cell((row as Record<string, unknown>)[column])));
  const widths = columns.map((column, index) => Math.max(column.length, ...cells.map((line) => line[index]!.length)));
  const format = (line: string[]) => line.map((value, index) => value.padEnd(widths[index]!)).join('  ').trimEnd();
  return [format([...columns]), format(widths.map((width) => '-'.repeat(width))), ...cells.map(format)].join('\n');
}

function cell(value: unknown): string {
  if (value === null || value === undefined) return '';
  if (value instanceof Date) return value.toISOString();
  return String(value);
}

/** A failure the user can act on: printed without a stack, exit code 1. */
export class CommandError extends Error {
  override name = 'CommandError';
}
