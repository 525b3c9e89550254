// A loopback port nobody listens on right now, for the servers whose port must be known before
// they run: the test harness's and the benchmark's embedded Postgres, the gateway processes
// they start, the fault suite's. Here, beside the project's own scripts, so that test/ and
// bench/ share it without either importing the other.
import { createServer } from 'node:net';

// The kernel may give a port it has just given back (a test asking for PORT then METRICS_PORT
// got the same one twice): a process never hands out one port twice.
const handedOut = new Set<number>();

export async function freePort(): Promise<number> {
  for (;;) {
    const port = await unusedPort();
    if (handedOut.has(port)) continue;
    handedOut.add(port);
    return port;
  }
}

function unusedPort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as { port: number };
      server.close(() => resolve(port));
    });
  });
}
