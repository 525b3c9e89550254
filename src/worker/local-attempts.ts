// Local attempts: a request accepted by a process that also runs a worker is run by that
// process at once, without the queue's hops (graphile-worker's fetch and lock of the job, and its
// removal, each a statement of its own).
// - A wait=true request's first attempt starts in the very statement that stores it: it is
//   stored as processing, with attempt 1 by this process (repository.insertRequests with a
//   Lease), and answered from the committed outcome: two commits between request and answer.
// - A wait=false request is stored queued, as its acknowledgement says, and claimed next by
//   this process (the claim groups with the queue's).
// - Its job is added in that statement too, as the queue's contract requires, but as a lease:
//   due only WORKER_DEAD_AFTER_MS later. While the attempt runs, the lease is pushed back.
// - Its outcome removes the lease job in the statement that records it; a retry goes through
//   the queue like any other.
// - If the process dies, the lease job comes due and a worker records the attempt as
//   worker_lost and retries it, as it does for the jobs of a pool whose heartbeat stopped.
// - Shutdown: running attempts get SHUTDOWN_GRACE_MS, then are aborted (recorded as
//   worker_lost, and retried at once by the queue).
// At most LOCAL_ATTEMPTS run at once; past that, requests take the queue. Several processes
// behind one load balancer each run what they accept; the queue still evens out the rest.
import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import { errorSummary, type Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';
import type { Logger } from '../logger.ts';
import { renewLeases, type Lease } from '../requests/repository.ts';
import type { Attempts, Recorded } from './process-request.ts';

export interface LocalAttemptsOptions {
  attempts: Attempts;
  db: Db;
  logger: Logger;
  /** Attempts running at once at most (LOCAL_ATTEMPTS). */
  capacity: number;
  /** How far ahead a lease job is due (WORKER_DEAD_AFTER_MS). */
  leaseMs: number;
  /** How long running attempts may finish at shutdown (SHUTDOWN_GRACE_MS). */
  graceMs: number;
}

/** A request stored with one of this process's leases. */
export interface LocalRequest {
  id: string;
  mode: KeyMode;
  /** JSON text of the upstream body, as stored. */
  body: string;
  leaseJobId: string;
}

export class LocalAttempts {
  /** The worker id of local attempts (request_attempts.worker_id). */
  readonly workerId = `local-${hostname()}-${process.pid}-${randomBytes(4).toString('hex')}`;
  readonly #options: LocalAttemptsOptions;
  readonly #log: Logger;
  /** Lease jobs of running attempts, by request id, with when each is due (this clock). */
  readonly #leases = new Map<string, { jobId: string; dueAt: number }>();
  readonly #running = new Set<Promise<Recorded>>();
  readonly #abort = new AbortController();
  readonly #renewal: NodeJS.Timeout;
  #reserved = 0;
  #stopping = false;

  constructor(options: LocalAttemptsOptions) {
    this.#options = options;
    this.#log = options.logger.child({ component: 'local-attempts' });
    // Several renewals per lease, as for heartbeats: a lease due within two periods is renewed.
    const everyMs = Math.max(100, Math.floor(options.leaseMs / 5));
    this.#renewal = setInterval(() => this.#renew(2 * everyMs), everyMs);
    this.#renewal.unref();
  }

  /** Attempts reserved or running. */
  get size(): number {
    return this.#reserved;
  }

  /**
   * A place for one more local attempt, as the lease to store the request with; undefined when
   * all are taken or the process is stopping. Hand it to run(), or give it back with release().
   */
  reserve(started: boolean): Lease | undefined {
    if (this.#stopping || this.#reserved >= this.#options.capacity) return undefined;
    this.#reserved++;
    return { workerId: this.workerId, leaseMs: this.#options.leaseMs, started };
  }

  /** Gives back a reservation whose request was not stored with it. */
  release(): void {
    this.#reserved--;
  }

  /**
   * Runs the first attempt of a request stored with `lease` (from reserve()), which it uses up:
   * at once if the lease started it, after claiming it if not. Never rejects: an outcome that
   * could not be recorded is left to the lease job ('stale').
   */
  run(request: LocalRequest, lease: Lease): Promise<Recorded> {
    this.#leases.set(request.id, { jobId: request.leaseJobId, dueAt: Date.now() + this.#options.leaseMs });
    const running: Promise<Recorded> = this.#attempt(request, lease.started)
      .catch((error: unknown) => {
        this.#log.error(
          { requestId: request.id, err: errorSummary(error) },
          'could not record a local attempt; its lease job will recover it',
        );
        return { status: 'stale' as const };
      })
      .finally(() => {
        this.#leases.delete(request.id);
        this.#running.delete(running);
        this.#reserved--;
      });
    this.#running.add(running);
    return running;
  }

  async #attempt(request: LocalRequest, started: boolean): Promise<Recorded> {
    const { attempts } = this.#options;
    const claimed = started
      ? { id: request.id, mode: request.mode, body: request.body, attempt: 1 }
      : await attempts.claim({ id: request.id, attempt: 1, workerId: this.workerId });
    // Not claimable: its lease job came due and a worker took it.
    if (!claimed) return { status: 'stale' };
    return attempts.run(claimed, this.#abort.signal, request.leaseJobId);
  }

  /** Takes no more; lets running attempts finish for SHUTDOWN_GRACE_MS, then aborts the rest. */
  async stop(): Promise<void> {
    this.#stopping = true;
    const all = () => Promise.all(this.#running);
    let timer: NodeJS.Timeout | undefined;
    const grace = new Promise<void>((resolve) => (timer = setTimeout(resolve, this.#options.graceMs)));
    await Promise.race([all(), grace]);
    clearTimeout(timer);
    this.#abort.abort();
    await all();
    clearInterval(this.#renewal);
  }

  #renew(withinMs: number): void {
    const now = Date.now();
    const due = [...this.#leases.values()].filter((lease) => lease.dueAt - now < withinMs);
    if (due.length === 0) return;
    renewLeases(this.#options.db, due.map((lease) => lease.jobId), this.#options.leaseMs).then(
      () => {
        for (const lease of due) lease.dueAt = now + this.#options.leaseMs;
      },
      (error: unknown) => this.#log.warn({ err: errorSummary(error), leases: due.length }, 'could not renew leases'),
    );
  }
}
