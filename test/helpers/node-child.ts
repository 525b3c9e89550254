// How a test starts Node processes of its own (a gateway, a command): with the test's node flags
// and environment, less tap's instrumentation. tap starts each test file with an import hook
// (@tapjs/processinfo; package.json's tap.plugin leaves out the plugins that would add more), as
// a flag and again in NODE_OPTIONS, which every Node process below it would load too: it records
// what each process loads, for coverage this suite does not take, and would nearly double the CPU
// a gateway process spends starting.

const isTapHook = (arg: string) => arg.includes('@tapjs/');

/** The test's own node flags (--conditions=gateway-source among them), without tap's hooks. */
export function childExecArgv(): string[] {
  return process.execArgv.filter((arg) => !isTapHook(arg));
}

/** The test's environment, without tap's hooks in NODE_OPTIONS (nor NODE_OPTIONS, when nothing else was in it). */
export function childEnv(): Record<string, string> {
  const { NODE_OPTIONS: options, ...env } = process.env as Record<string, string>;
  // tap writes each flag as a quoted word: "--import=file:///.../@tapjs/processinfo/dist/esm/import.mjs".
  const kept = (options ?? '').match(/"[^"]*"|\S+/g)?.filter((word) => !isTapHook(word)) ?? [];
  return kept.length > 0 ? { ...env, NODE_OPTIONS: kept.join(' ') } : env;
}
