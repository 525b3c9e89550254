// Reads of keys the cache does not hold, bounded per API process: at most IN_FLIGHT under way
// (each holds one of the API pool's connections), and WAITING more in line for their turn, first
// come first served. Beyond that a request is refused 503 service_unavailable with retry-after.
//
// A flood of keys that pass the checksum (computed by someone who read ids.ts, or of the length
// keys had before checksums while more of them are active than a process keeps: unchecksummed.ts)
// then holds a few of the pool's connections, not all of them, and the rest serve the requests of
// keys the cache holds, which never come here. Why 503 and not 401: the key may be good, it was
// not looked at, and a client must not be told it is invalid (the client library does not retry
// a 401; it retries a 503 after its retry-after). Why not 429: that is a key's own rate; this is
// the process's load, whoever sends it.
import { serviceUnavailable } from '../errors.ts';
import { Line } from '../line.ts';

/** Reads under way at once: a few of the API pool's connections (DATABASE_POOL_SIZE, 10 by default). */
const IN_FLIGHT = 4;
/**
 * Reads waiting for their turn. A read by the key's unique index takes about a millisecond, so
 * a full line is through in tens of milliseconds while the database is well.
 */
const WAITING = 64;

export class KeyReads extends Line {
  constructor(options: { inFlight?: number; waiting?: number; onRefused?: () => void } = {}) {
    super({
      inFlight: options.inFlight ?? IN_FLIGHT,
      waiting: options.waiting ?? WAITING,
      refusal: () => serviceUnavailable(1, 'The gateway is busy; try again in a moment.'),
      onRefused: options.onRefused,
    });
  }
}
