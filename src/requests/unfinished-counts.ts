// MAX_UNFINISHED_PER_PROJECT: per project and mode seen lately, its unfinished requests as of the
// last count plus what this process admitted since, counted for all of them in one statement in
// the background (each count stopping at the limit + 1), so that a request costs no database
// round trip. A project first seen is admitted until its first count arrives, moments later (it
// is counted early). When the database cannot be reached, a process counts only its own
// admissions against projects.
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
  /** Admitted here since the last count began. */
  admitted: number;
  /** The last submission seen (admitted or not). */
  activeAt: number;
}

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

  /** The project's count, or the 429 when it is at its limit. */
  check(auth: Auth): ProjectCount {
    const now = performance.now();
    const key = `${auth.mode} ${auth.projectId}`;
    let project = this.#projects.get(key);
    if (!project) {
      project = { projectId: auth.projectId, mode: auth.mode, counted: undefined, admitted: 0, activeAt: now };
      this.#projects.set(key, project);
      this.#loop.soon();
    }
    project.activeAt = now;
    if ((project.counted ?? 0) + project.admitted >= this.#max) {
      throw rateLimitExceeded(
        1,
        `This project has ${this.#max} ${auth.mode} requests not yet finished, its limit (MAX_UNFINISHED_PER_PROJECT); retry after 1 s.`,
      );
    }
    return project;
  }

  /** Counts the admission check() allowed. */
  take(project: ProjectCount): void {
    project.admitted++;
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
    const counting: { project: ProjectCount; admitted: number }[] = [];
    for (const [key, project] of this.#projects) {
      if (now - project.activeAt > this.#idleMs) {
        this.#projects.delete(key);
        continue;
      }
      counting.push({ project, admitted: 0 });
    }
    if (counting.length === 0) return;

    let counts: number[];
    try {
      counts = await this.#db.connection().execute((connection) => {
        // Read once the connection is held, as the statement leaves: a request admitted later
        // is stored later still, so it cannot be in the count and stays added on. Read before
        // waiting for a connection, the requests admitted and stored during the wait would be
        // both in the count and added on, and refuse a project below its limit.
        for (const entry of counting) entry.admitted = entry.project.admitted;
        return repository.countUnfinished(
          connection,
          counting.map(({ project }) => project),
          this.#max + 1,
        );
      });
    } catch (error) {
      this.#loop.failed('unfinished', error);
      return;
    }
    this.#loop.succeeded('unfinished');
    for (const [index, { project, admitted }] of counting.entries()) {
      // What was admitted before the statement left and is not stored yet is missing from the
      // count until the next one: a project may go over its limit by that much, for one sync.
      project.counted = counts[index]!;
      project.admitted -= admitted;
    }
  }
}
