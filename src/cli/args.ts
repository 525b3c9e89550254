// Command-line arguments, parsed strictly (node:util parseArgs): a mistake in them is a
// UsageError, which cli.ts prints with the usage (exit code 2).
import { parseArgs } from 'node:util';

export class UsageError extends Error {
  override name = 'UsageError';
}

type Options = NonNullable<Parameters<typeof parseArgs>[0]>['options'];

export function parse<T extends Options>(args: string[], options: T, allowPositionals = false) {
  try {
    return parseArgs({ args, options: options as T & {}, allowPositionals, strict: true });
  } catch (error) {
    throw new UsageError((error as Error).message);
  }
}
