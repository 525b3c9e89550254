// How long processes of the machine wait on its disk, looked at every DISK_LOOK_MS. A commit
// waits for its WAL's flush, so a flush that takes hundreds of milliseconds stalls every commit
// behind it, whoever's; on the virtual machines this project is measured on, such flushes come
// and go with no load at all, and a window of measurements that meets one has a slower p99 for
// it. The benchmark (bench/cpu.ts) and the noisy-neighbour scenario (test/faults) print these
// figures beside their own, so that a reader can tell the disk's stall from the gateway's.
// Here, beside the project's own scripts, so that test/ and bench/ share it without either
// importing the other.
import { readFileSync } from 'node:fs';

export const DISK_LOOK_MS = 20;

/** Processes of the machine waiting on I/O now (procs_blocked in /proc/stat); undefined off Linux. */
export function processesWaitingOnDisk(): number | undefined {
  try {
    const match = /^procs_blocked (\d+)$/m.exec(readFileSync('/proc/stat', 'latin1'));
    return match ? Number(match[1]) : undefined;
  } catch {
    return undefined;
  }
}

export interface DiskWaitFigures {
  looks: number;
  /** Looks that found a process waiting on the disk. */
  waiting: number;
  /** The longest run of such looks, from the first to the first look after it that found none (ms). */
  longestMs: number;
}

/**
 * The looks of one window. A look is of the whole machine: any process's wait counts (a page
 * read, too), and most are a look long; a stalled flush is a run of looks.
 */
export class DiskWaitTally {
  #looks = 0;
  #waiting = 0;
  #longestMs = 0;
  #since: number | undefined;

  /** A look at `now` (ms) that found `waiting` processes waiting. */
  add(now: number, waiting: number): void {
    this.#looks++;
    if (waiting > 0) {
      this.#waiting++;
      this.#since ??= now;
    } else {
      this.close(now);
    }
  }

  /** Ends a run of waiting looks still open at `now` (the window ends). */
  close(now: number): void {
    if (this.#since === undefined) return;
    this.#longestMs = Math.max(this.#longestMs, now - this.#since);
    this.#since = undefined;
  }

  figures(): DiskWaitFigures {
    return { looks: this.#looks, waiting: this.#waiting, longestMs: Math.round(this.#longestMs) };
  }
}

export const formatDiskWaits = (figures: DiskWaitFigures): string =>
  `the disk: a process of the machine waited on it in ${figures.waiting} of ${figures.looks} looks (${DISK_LOOK_MS} ms apart), at most ${figures.longestMs} ms in a row`;
