// `gateway <command>` as a child process of the test, run to its end: its exit code and what it
// printed.
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { childEnv } from './node-child.ts';

const CLI = new URL('../../src/cli.ts', import.meta.url).pathname;

export interface CliResult {
  code: number;
  stdout: string;
  stderr: string;
}

/**
 * Runs `gateway <args>` with `env` over the test's own environment, at LOG_LEVEL=warn. The
 * database and the encryption keys are never inherited (the test run's DATABASE_URL is the
 * server's admin database): a command gets those only from `env`.
 */
export async function runCli(args: string[], env: Record<string, string | undefined> = {}): Promise<CliResult> {
  const { DATABASE_URL: _url, SECRET_ENCRYPTION_KEY: _key, SECRET_ENCRYPTION_KEYS: _keys, ...inherited } = childEnv();
  try {
    const { stdout, stderr } = await promisify(execFile)(process.execPath, [CLI, ...args], {
      env: { ...inherited, LOG_LEVEL: 'warn', ...env },
    });
    return { code: 0, stdout, stderr };
  } catch (error) {
    const failed = error as { code: number; stdout: string; stderr: string };
    return { code: failed.code, stdout: failed.stdout, stderr: failed.stderr };
  }
}

/** What `gateway <args>` printed on stdout; a command that fails throws, with what it said. */
export async function cliOutput(args: string[], env: Record<string, string | undefined> = {}): Promise<string> {
  const result = await runCli(args, env);
  if (result.code !== 0) throw new Error(`gateway ${args.join(' ')} exited ${result.code}: ${result.stderr}`);
  return result.stdout;
}
