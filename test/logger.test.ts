// The logs (src/logger.ts): each line's time, and their standard output: the lines of one turn of
// the event loop go out in one write at the turn's end, in order, and a process that exits writes
// its last lines first.
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import t from 'tap';
import { createLogger, TurnBatchedOutput } from '../src/logger.ts';
import { childEnv, childExecArgv } from './helpers/node-child.ts';

const nextTurn = () => new Promise<void>((resolve) => setImmediate(resolve));

const recorder = () => {
  const writes: string[] = [];
  return { writes, output: new TurnBatchedOutput({ write: (text: string) => void writes.push(text) }) };
};

t.test('the lines logged in one turn are written together at its end, in order', async (t) => {
  const { writes, output } = recorder();
  output.write('{"n":1}\n');
  output.write('{"n":2}\n');
  output.write('{"n":3}\n');
  t.same(writes, [], 'nothing is written while the turn runs');
  await nextTurn();
  t.same(writes, ['{"n":1}\n{"n":2}\n{"n":3}\n'], 'one write at its end');
  output.write('{"n":4}\n');
  await nextTurn();
  t.same(writes.slice(1), ['{"n":4}\n'], "the next turn's line in a write of its own");
});

t.test('a turn that logs 1,048,576 characters or more writes them at once', async (t) => {
  const { writes, output } = recorder();
  const line = `${'x'.repeat(64 * 1024)}\n`;
  for (let i = 0; i < 16; i++) output.write(line);
  t.equal(writes.length, 1, 'written when the 1,048,576th character was reached');
  t.equal(writes[0]!.length, 16 * line.length);
  output.write('{"after":true}\n');
  await nextTurn();
  t.same(writes.slice(1), ['{"after":true}\n'], 'and the rest at the turn\'s end');
});

t.test("a process that exits in the turn that logged writes the turn's lines first", async (t) => {
  const script = `
    import { createLogger } from ${JSON.stringify(new URL('../src/logger.ts', import.meta.url).href)};
    const logger = createLogger({ logLevel: 'info' });
    for (let i = 0; i < 3; i++) logger.info({ i }, 'before exiting');
    process.exit(3);
  `;
  const run = promisify(execFile)(process.execPath, [...childExecArgv(), '--input-type=module', '-e', script], { env: childEnv() });
  const failure = await run.then(() => undefined, (error: { code?: number; stdout?: string }) => error);
  t.equal(failure?.code, 3, 'it exited with its code');
  const lines = (failure?.stdout ?? '').trim().split('\n').map((line) => JSON.parse(line) as { i: number; msg: string });
  t.same(lines.map((line) => [line.i, line.msg]), [[0, 'before exiting'], [1, 'before exiting'], [2, 'before exiting']]);
});

t.test("each line's time is the moment it was logged, to the millisecond, in ISO 8601", async (t) => {
  const lines: string[] = [];
  const logger = createLogger({ logLevel: 'info' }, { write: (line: string) => void lines.push(line) });
  const times: [number, number][] = [];
  for (let i = 0; i < 5; i++) {
    const before = Date.now();
    logger.info({ i }, 'line');
    times.push([before, Date.now()]);
    // Some lines in the same millisecond as the one before, some in a later one.
    if (i % 2 === 1) await new Promise((resolve) => setTimeout(resolve, 3));
  }
  t.equal(lines.length, 5);
  lines.forEach((line, index) => {
    const { time } = JSON.parse(line) as { time: string };
    t.match(time, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/, `line ${index}: ISO 8601, UTC, milliseconds`);
    const [before, after] = times[index]!;
    t.ok(Date.parse(time) >= before && Date.parse(time) <= after, `line ${index}: the moment it was logged`);
  });
});
