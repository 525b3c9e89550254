// `gateway <command>` run to its end: its exit code and what it printed. runCli runs it in the
// test's own process (what src/cli.ts runs, less the process around it: a Node process of its own
// spends most of a second loading the gateway's modules); runCliProcess as a process of its own,
// for what the process adds (exit codes, the streams).
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { runCommandLine } from '../../src/cli/command-line.ts';
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
  let stdout = '';
  let stderr = '';
  const code = await runCommandLine(args, {
    env: commandEnv(process.env, env),
    out: (text) => (stdout += `${text}\n`),
    err: (text) => (stderr += `${text}\n`),
  });
  return { code, stdout, stderr };
}

/** runCli's command as a process of its own (`node src/cli.ts <args>`). */
export async function runCliProcess(args: string[], env: Record<string, string | undefined> = {}): Promise<CliResult> {
  try {
    const { stdout, stderr } = await promisify(execFile)(process.execPath, [CLI, ...args], { env: commandEnv(childEnv(), env) });
    return { code: 0, stdout, stderr };
  } catch (error) {
    const failed = error as { code: number; stdout: string; stderr: string };
    return { code: failed.code, stdout: failed.stdout, stderr: failed.stderr };
  }
}

/** What a command prints on stdout; a command that fails throws, with what it said. */
export async function cliOutput(args: string[], env: Record<string, string | undefined> = {}): Promise<string> {
  const result = await runCli(args, env);
  if (result.code !== 0) throw new Error(`gateway ${args.join(' ')} exited ${result.code}: ${result.stderr}`);
  return result.stdout;
}

function commandEnv(inherited: Record<string, string | undefined>, env: Record<string, string | undefined>): Record<string, string | undefined> {
  const { DATABASE_URL: _url, SECRET_ENCRYPTION_KEY: _key, SECRET_ENCRYPTION_KEYS: _keys, ...rest } = inherited;
  return { ...rest, LOG_LEVEL: 'warn', ...env };
}
