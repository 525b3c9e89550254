// MAX_UNFINISHED_PER_PROJECT: per project and mode seen lately, its unfinished requests as of the
// last count plus the requests this process admitted that no count has seen yet, so that a request
// costs no database round trip. The counts are taken for all projects in one statement in the
// background (each stopping at the limit + 1). A project first seen (or seen again after a quiet
// spell) is counted at once, and its submissions wait for that count (`counted`): admitted on this
// process's admissions alone, a project already at its limit through other processes, or through
// requests of its own still unfinished, would get its whole limit again. When the database cannot
// be reached, a process counts only its own admissions against projects.
//
// An admission is known by its request's id, and a count settles which admissions it saw: in one
// repeatable-read transaction, it counts, and then looks up the ids admitted up to then. A request
// in the count's snapshot was committed before the snapshot was taken, so admitted before the
// lookup's list was read, and it is found; one not found is not in the count either, and stays
// added on. Each request is counted once however its insert and the count overlap.
import type { Db } from '../db/pool.ts';
import { rateLimitExceeded } from '../errors.ts';
import type { KeyMode } from '../ids.ts';
import type { Auth } from '../keys/auth.ts';
import type { Logger } from '../logger.ts';
import * as repository from './intake-repository.ts';
import { SyncLoop } from './sync-loop.ts';

export interface ProjectCount {
  readonly projectId: string;
  readonly mode: KeyMode;
  /** Its unfinished requests as last counted (at most the limit + 1); undefined until counted once. */
  counted: number | undefined;
  /** Requests admitted here that no count has seen yet: id -> when admitted (performance.now()). */
  readonly pending: Map<string, number>;
  /** The last submission seen (admitted or not). */
  activeAt: number;
}

/**
 * An admission neither seen by a count nor withdrawn after this long is dropped: its request was
 * never stored (withdraw() is how the caller says so; this covers a path that did not).
 */
const PENDING_EXPIRY_MS = 60_000;

/**
 * How long a submission of a project not counted yet waits for its count, at most: past it (a
 * database slow to answer), it is decided on this process's own admissions, as while the database
 * cannot be reached.
 */
const COUNT_WAIT_MS = 1_000;

export interface UnfinishedCountsOptions {
  syncMs: number;
  /** Projects not seen for this long are forgotten. */
  idleMs: number;
  logger?: Logger | undefined;
  logFields?: Record<string, unknown>;
}

export class UnfinishedCounts {
  readonly #db: Db;
  readonly #max: number;
  readonly #idleMs: number;
  readonly #projects = new Map<string, ProjectCount>();
  readonly #loop: SyncLoop;
  /** A count asked for by submissions waiting for their project's (#countNow). */
  #counting: Promise<void> | undefined;

  constructor(db: Db, max: number, options: UnfinishedCountsOptions) {
    this.#db = db;
    this.#max = max;
    this.#idleMs = options.idleMs;
    this.#loop = new SyncLoop(() => this.#syncOnce(), options);
  }

  /** Projects (per mode) tracked. */
  get size(): number {
    return this.#projects.size;
  }

  /**
   * Resolves once the project (as check() gave it) has been counted, or a count was tried and
   * could not say (the database failing or slow to answer): undefined when it was counted
   * already, or the counts are failing or stopped, so that there is nothing to wait for.
   */
  counted(project: ProjectCount): Promise<void> | undefined {
    if (project.counted !== undefined || this.#loop.failing || this.#loop.stopped) return undefined;
    return (async () => {
      const giveUpAt = performance.now() + COUNT_WAIT_MS;
      // A count under way may have listed its projects before this one: then one more.
      for (let round = 0; round < 2 && project.counted === undefined && !this.#loop.failing; round++) {
        const left = giveUpAt - performance.now();
        if (left <= 0) return;
        let timer: NodeJS.Timeout | undefined;
        await Promise.race([this.#countNow(), new Promise<void>((resolve) => (timer = setTimeout(resolve, left)))]);
        clearTimeout(timer);
      }
    })();
  }

  /** The project's count (tracked from now if it was not: it is counted early), or the 429 when it is at its limit. */
  check(auth: Auth): ProjectCount {
    const now = performance.now();
    const key = `${auth.mode} ${auth.projectId}`;
    let project = this.#projects.get(key);
    if (!project) {
      project = { projectId: auth.projectId, mode: auth.mode, counted: undefined, pending: new Map(), activeAt: now };
      this.#projects.set(key, project);
      this.#loop.soon();
    }
    project.activeAt = now;
    if ((project.counted ?? 0) + project.pending.size >= this.#max) {
      throw rateLimitExceeded(
        1,
        `This project has ${this.#max} ${auth.mode} requests not yet finished, its limit (MAX_UNFINISHED_PER_PROJECT); retry after 1 s.`,
      );
    }
    return project;
  }

  /** A count of every project now, shared by all who ask while it is under way. */
  #countNow(): Promise<void> {
    this.#counting ??= this.#loop.sync().finally(() => {
      this.#counting = undefined;
    });
    return this.#counting;
  }

  /** Counts the admission check() allowed, of the request `requestId`, until a count sees it. */
  take(project: ProjectCount, requestId: string): void {
    project.pending.set(requestId, performance.now());
  }

  /** The admitted request `requestId` was not stored (refused later, replayed, or failed). */
  withdraw(auth: Auth, requestId: string): void {
    this.#projects.get(`${auth.mode} ${auth.projectId}`)?.pending.delete(requestId);
  }

  start(): void {
    this.#loop.start();
  }

  sync(): Promise<void> {
    return this.#loop.sync();
  }

  stop(): Promise<void> {
    return this.#loop.stop();
  }

  async #syncOnce(): Promise<void> {
    const now = performance.now();
    const counting: ProjectCount[] = [];
    for (const [key, project] of this.#projects) {
      if (now - project.activeAt > this.#idleMs) {
        this.#projects.delete(key);
        continue;
      }
      counting.push(project);
    }
    if (counting.length === 0) return;

    let counted: { counts: number[]; seen: Set<string> };
    try {
      counted = await this.#db
        .transaction()
        .setIsolationLevel('repeatable read')
        .setAccessMode('read only')
        .execute(async (tx) => {
          const counts = await repository.countUnfinished(tx, counting, this.#max + 1);
          // Read now, after the count's snapshot was taken: every request in it is among these.
          const admitted = counting.flatMap((project) => [...project.pending.keys()]);
          const seen = admitted.length === 0 ? [] : await repository.storedRequests(tx, admitted);
          return { counts, seen: new Set(seen) };
        });
    } catch (error) {
      this.#loop.failed('unfinished', error);
      return;
    }
    this.#loop.succeeded('unfinished');
    const expired = performance.now() - PENDING_EXPIRY_MS;
    for (const [index, project] of counting.entries()) {
      project.counted = counted.counts[index]!;
      for (const [id, admittedAt] of project.pending) {
        if (counted.seen.has(id) || admittedAt < expired) project.pending.delete(id);
      }
    }
  }
}
