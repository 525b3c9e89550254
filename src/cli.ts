#!/usr/bin/env node
// gateway: the command line (docs/cli.md). From a checkout: npm run gateway -- <command>.
// This file runs the command (src/cli/command-line.ts) for this process.
import './heap.ts'; // first: V8 settings that must precede any allocation
import { runCommandLine } from './cli/command-line.ts';

const code = await runCommandLine(process.argv.slice(2), {
  env: process.env,
  out: (text) => console.log(text),
  err: (text) => console.error(text),
});
if (code !== 0) {
  // A failed command may leave something holding the event loop (an embedded Postgres that did
  // not start, say): the process ends once what it printed is written.
  process.exitCode = code;
  process.stdout.write('', () => process.stderr.write('', () => process.exit(code)));
}
