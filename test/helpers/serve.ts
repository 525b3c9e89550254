// `gateway serve` as a child process of the test, its output (stdout and stderr) collected.
import { spawn, type ChildProcess } from 'node:child_process';
import type { Config } from '../../src/config.ts';
import type { Teardown } from './teardown.ts';

export interface ServeProcess {
  child: ChildProcess;
  /** Everything it has printed so far. */
  output(): string;
  /** Its exit code, once it has exited. */
  exited: Promise<number | null>;
}

/**
 * Starts `gateway serve` (with `args`, e.g. ['--role', 'worker']) with these settings over the
 * test's own environment, and `nodeArgs` for node itself; killed at teardown.
 */
export function spawnServe(t: Teardown, env: Record<string, string>, args: string[] = [], nodeArgs: string[] = []): ServeProcess {
  const cli = new URL('../../src/cli.ts', import.meta.url).pathname;
  const child = spawn(process.execPath, [...process.execArgv, ...nodeArgs, cli, 'serve', ...args], {
    env: { ...process.env, ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let output = '';
  child.stdout.on('data', (chunk) => (output += chunk));
  child.stderr.on('data', (chunk) => (output += chunk));
  const exited = new Promise<number | null>((resolve) => child.on('exit', resolve));
  t.teardown(() => {
    if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
  });
  return { child, output: () => output, exited };
}

/**
 * The settings of a `gateway serve` child that shares a test gateway's database and encryption
 * key, listening on `port` on loopback; `settings` add to them or override them.
 */
export function serveSettings(
  gateway: { databaseUrl: string; config: Pick<Config, 'secretEncryptionKeys'> },
  port: number,
  settings: Record<string, string> = {},
): Record<string, string> {
  return {
    DATABASE_URL: gateway.databaseUrl,
    SECRET_ENCRYPTION_KEY: gateway.config.secretEncryptionKeys[0]!.toString('base64'),
    PORT: String(port),
    HOST: '127.0.0.1',
    ...settings,
  };
}
