// A loopback port nobody listens on right now (the test harness, the benchmark and the fault
// suite pick the ports of the servers they start with it).
import { createServer } from 'node:net';

export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as { port: number };
      server.close(() => resolve(port));
    });
  });
}

interface Teardown {
  teardown(fn: () => Promise<void> | void): void;
}

/** Starts a test's HTTP server on a loopback port, closed (connections and all) at teardown. */
export async function listenOnLoopback(t: Teardown, server: import('node:http').Server): Promise<number> {
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  t.teardown(
    () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections();
        server.close(() => resolve());
      }),
  );
  return (server.address() as import('node:net').AddressInfo).port;
}
