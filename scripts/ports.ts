// A loopback port nobody listens on right now, for the servers whose port must be known before
// they run: the test harness's and the benchmark's embedded Postgres, the gateway processes
// they start, the fault suite's. Here, beside the project's own scripts, so that test/ and
// bench/ share it without either importing the other.
//
// The port is chosen below the kernel's range of ephemeral ports (on Linux,
// /proc/sys/net/ipv4/ip_local_port_range), not given by the kernel from that range: every
// outgoing connection of the machine takes a local port from it, and one that took the port
// between its choice and the server's start (the suite's other files connect thousands of
// times a second) would refuse the server's bind ("could not create any TCP/IP sockets").
// Where the range cannot be read, or leaves no room below it, the kernel chooses (port 0).
import { readFileSync } from 'node:fs';
import { createServer } from 'node:net';

/** The lowest port chosen: above the well-known and the commonly configured ones. */
const LOWEST = 10_000;

// The kernel may give a port it has just given back (a test asking for PORT then METRICS_PORT
// got the same one twice): a process never hands out one port twice.
const handedOut = new Set<number>();

/** The ports below the ephemeral range to choose from: [first, last], or undefined. */
const belowEphemeral: [number, number] | undefined = (() => {
  try {
    const low = Number(readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/)[0]);
    return Number.isInteger(low) && low - 1 - LOWEST >= 1_000 ? [LOWEST, low - 1] : undefined;
  } catch {
    return undefined;
  }
})();

export async function freePort(): Promise<number> {
  for (;;) {
    const wanted = belowEphemeral && belowEphemeral[0] + Math.floor(Math.random() * (belowEphemeral[1] - belowEphemeral[0] + 1));
    const port = await unusedPort(wanted ?? 0);
    if (port === undefined || handedOut.has(port)) continue;
    handedOut.add(port);
    return port;
  }
}

/** `port` (0: one the kernel chooses) if nobody listens on it now; undefined if it is taken. */
function unusedPort(port: number): Promise<number | undefined> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', (error: NodeJS.ErrnoException) => (error.code === 'EADDRINUSE' && port !== 0 ? resolve(undefined) : reject(error)));
    server.listen(port, '127.0.0.1', () => {
      const { port: bound } = server.address() as { port: number };
      server.close(() => resolve(bound));
    });
  });
}
