// A loopback port nobody listens on right now, for the servers the benchmark starts (the
// gateway's processes, an embedded Postgres) whose port it must know before they run.
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
