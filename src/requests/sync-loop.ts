// A background synchronisation run every `syncMs`, or sooner when asked (`soon`), never two at
// once: what each intake limit (key-rates.ts, unfinished-counts.ts) uses to bring its local state
// in line with the other API processes'. It also keeps the limit's warnings to one per part that
// starts failing, and one line when it works again.
import { errorSummary } from '../db/pool.ts';
import type { Logger } from '../logger.ts';

/** A sync asked for `soon` runs this fraction of a period after the last one. */
const EARLY_SYNC = 0.1;

export class SyncLoop {
  readonly #syncOnce: () => Promise<void>;
  readonly #syncMs: number;
  readonly #logger: Logger | undefined;
  readonly #logFields: Record<string, unknown>;
  #started = false;
  #stopped = false;
  #timer: NodeJS.Timeout | undefined;
  /** A sync was asked for soon since the last one began. */
  #soon = false;
  #syncing: Promise<void> | undefined;
  #lastSyncAt = -Infinity;
  /** The parts of the sync failing now: each is logged as a warning when it starts failing. */
  readonly #failing = new Set<string>();

  /** `syncOnce` never rejects: it reports its failures through failed(). */
  constructor(syncOnce: () => Promise<void>, options: { syncMs: number; logger?: Logger | undefined; logFields?: Record<string, unknown> }) {
    this.#syncOnce = syncOnce;
    this.#syncMs = options.syncMs;
    this.#logger = options.logger;
    this.#logFields = options.logFields ?? {};
  }

  get stopped(): boolean {
    return this.#stopped;
  }

  /** Whether the last sync of some part failed (and none has succeeded since). */
  get failing(): boolean {
    return this.#failing.size > 0;
  }

  /** Synchronises every `syncMs` from now on. */
  start(): void {
    if (this.#started || this.#stopped) return;
    this.#started = true;
    this.#schedule();
  }

  /** Stops; waits for a sync under way. */
  async stop(): Promise<void> {
    this.#stopped = true;
    clearTimeout(this.#timer);
    this.#timer = undefined;
    while (this.#syncing) await this.#syncing;
  }

  /** Synchronises now, after the sync under way, if any. Never rejects. */
  async sync(): Promise<void> {
    while (this.#syncing) await this.#syncing;
    this.#lastSyncAt = performance.now();
    const syncing = this.#syncOnce().finally(() => {
      this.#syncing = undefined;
    });
    this.#syncing = syncing;
    await syncing;
    if (this.#started) this.#schedule();
  }

  /** Something new was seen: the next sync comes early (if started). */
  soon(): void {
    if (!this.#started || this.#stopped || this.#soon) return;
    this.#soon = true;
    // A sync under way schedules the next when it ends.
    if (!this.#syncing) this.#schedule();
  }

  failed(part: string, error: unknown): void {
    const fields = { ...this.#logFields, err: errorSummary(error), part };
    if (this.#failing.has(part)) {
      this.#logger?.debug(fields, 'intake limits still not synchronised');
      return;
    }
    this.#failing.add(part);
    this.#logger?.warn(fields, 'could not synchronise the intake limits; deciding on this process\'s own counts meanwhile');
  }

  succeeded(part: string): void {
    if (this.#failing.delete(part)) this.#logger?.info({ ...this.#logFields, part }, 'intake limits synchronised again');
  }

  #schedule(): void {
    if (this.#stopped) return;
    clearTimeout(this.#timer);
    const delay = this.#lastSyncAt + (this.#soon ? EARLY_SYNC : 1) * this.#syncMs - performance.now();
    this.#timer = setTimeout(() => this.#tick(), Math.max(0, delay)).unref();
  }

  #tick(): void {
    this.#timer = undefined;
    this.#soon = false;
    // sync() never rejects, and schedules the next; stop() waits for it.
    void this.sync();
  }
}
