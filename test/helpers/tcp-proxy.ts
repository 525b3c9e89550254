// A TCP proxy on loopback in front of the test's Postgres that can be cut: an outage as the
// gateway sees it (connections dropped without a word, new ones closed at once), without
// stopping the server that the other tests share.
import net from 'node:net';
import type { Teardown } from './teardown.ts';

export interface TcpProxy {
  /** `databaseUrl` with its host and port replaced by the proxy's. */
  url: string;
  /** Drops every connection, and closes new ones as soon as they open, until restored. */
  cut(): void;
  restore(): void;
}

export async function startTcpProxy(t: Teardown, databaseUrl: string): Promise<TcpProxy> {
  const target = new URL(databaseUrl);
  const open = new Set<net.Socket>();
  let cut = false;
  const server = net.createServer((client) => {
    if (cut) {
      client.destroy();
      return;
    }
    const upstream = net.connect(Number(target.port || 5432), target.hostname);
    for (const socket of [client, upstream]) {
      open.add(socket);
      socket.on('close', () => open.delete(socket));
      socket.on('error', () => {});
    }
    client.pipe(upstream).pipe(client);
    const end = () => {
      client.destroy();
      upstream.destroy();
    };
    client.on('close', end);
    upstream.on('close', end);
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as net.AddressInfo;
  t.teardown(
    () =>
      new Promise<void>((resolve) => {
        for (const socket of open) socket.destroy();
        server.close(() => resolve());
      }),
  );
  const url = new URL(databaseUrl);
  url.hostname = '127.0.0.1';
  url.port = String(port);
  return {
    url: url.toString(),
    cut() {
      cut = true;
      for (const socket of open) socket.destroy();
    },
    restore() {
      cut = false;
    },
  };
}
