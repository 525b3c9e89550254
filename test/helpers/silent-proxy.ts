// A loopback TCP proxy in front of Postgres that can make connections go silent: stop
// forwarding their bytes in both directions while keeping both sockets open, as a NAT or load
// balancer that forgets a flow does. Neither end hears a thing; only a round trip that never
// comes back tells. Each connection is known by the application_name of its StartupMessage
// (sent in plain text), so a test can silence one kind (e.g. 'gateway-listen') and leave the
// rest working. New connections are forwarded normally, as after a real drop.
// (tcp-proxy.ts is the other kind of fault: connections cut, new ones refused.)
import net from 'node:net';
import type { Teardown } from './teardown.ts';

interface Forwarded {
  client: net.Socket;
  server: net.Socket;
  /** From the StartupMessage, once it has been read. */
  applicationName: string | undefined;
  silenced: boolean;
}

export interface SilentProxy {
  /** The database URL given, pointing at the proxy. */
  url: string;
  /** Silences the connections open now whose application_name is this; returns how many. */
  blackHole(applicationName: string): number;
  /** The application_name of each connection open now (undefined until its startup is read). */
  open(): (string | undefined)[];
  /**
   * Once: calls `then` right after forwarding the next bytes from Postgres to a connection of
   * this application_name, in the same callback, so before a client in this process has read them.
   */
  afterNextReply(applicationName: string, then: () => void): void;
}

export async function startSilentProxy(t: Teardown, databaseUrl: string): Promise<SilentProxy> {
  const target = new URL(databaseUrl);
  const connections = new Set<Forwarded>();
  const hooks: { applicationName: string; then: () => void }[] = [];
  const server = net.createServer((client) => {
    const upstream = net.connect(Number(target.port || 5432), target.hostname);
    const forwarded: Forwarded = { client, server: upstream, applicationName: undefined, silenced: false };
    connections.add(forwarded);
    let head = Buffer.alloc(0);
    client.on('data', (chunk: Buffer) => {
      if (forwarded.applicationName === undefined && head.length < 8192) {
        head = Buffer.concat([head, chunk]);
        forwarded.applicationName = applicationNameOf(head);
      }
      if (!forwarded.silenced) upstream.write(chunk);
    });
    upstream.on('data', (chunk: Buffer) => {
      if (forwarded.silenced) return;
      client.write(chunk);
      const hook = hooks.findIndex((entry) => entry.applicationName === forwarded.applicationName);
      if (hook >= 0) hooks.splice(hook, 1)[0]!.then();
    });
    const close = () => {
      connections.delete(forwarded);
      client.destroy();
      upstream.destroy();
    };
    for (const socket of [client, upstream]) {
      socket.on('error', close);
      socket.on('close', close);
    }
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  t.teardown(
    () =>
      new Promise<void>((resolve) => {
        for (const { client, server: upstream } of connections) {
          client.destroy();
          upstream.destroy();
        }
        server.close(() => resolve());
      }),
  );
  const url = new URL(databaseUrl);
  url.hostname = '127.0.0.1';
  url.port = String((server.address() as net.AddressInfo).port);
  return {
    url: url.toString(),
    blackHole(applicationName) {
      let count = 0;
      for (const connection of connections) {
        if (connection.applicationName !== applicationName) continue;
        connection.silenced = true;
        count++;
      }
      return count;
    },
    open: () => [...connections].map((connection) => connection.applicationName),
    afterNextReply: (applicationName, then) => void hooks.push({ applicationName, then }),
  };
}

/**
 * The application_name of a StartupMessage (Int32 length, Int32 protocol 3.0, then name\0value\0
 * pairs and a final \0), once `head` holds all of it; '' when it names none, undefined until then.
 */
function applicationNameOf(head: Buffer): string | undefined {
  if (head.length < 8) return undefined;
  const length = head.readInt32BE(0);
  if (head.length < length) return undefined;
  if (head.readInt32BE(4) !== 196_608) return '';
  const fields = head.subarray(8, length - 1).toString('utf8').split('\0');
  for (let i = 0; i + 1 < fields.length; i += 2) if (fields[i] === 'application_name') return fields[i + 1];
  return '';
}
