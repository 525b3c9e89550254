import type { Teardown } from './teardown.ts';
// Ports for a test's servers: freePort (shared with the benchmark, from scripts/ports.ts), and
// listenOnLoopback for a server the test starts itself.
export { freePort } from '../../scripts/ports.ts';

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
