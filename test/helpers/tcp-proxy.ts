// A TCP proxy on loopback in front of the test's Postgres, for faults of the network between the
// gateway and its database without stopping the server that the other tests share:
// - cut: every connection dropped without a word, new ones closed at once, until restored (an
//   outage as the gateway sees it);
// - black hole: connections go silent, their bytes no longer forwarded either way while both
//   sockets stay open, as a NAT or load balancer that forgets a flow does. Neither end hears a
//   thing; only a round trip that never comes back tells. New connections are forwarded
//   normally, as after a real drop;
// - a lost answer: a connection dropped in place of forwarding a reply, so that what Postgres
//   did (a statement it committed) is never heard of by the client.
// Each connection is known by the application_name of its StartupMessage (sent in plain text), so
// a test can silence one kind (e.g. 'gateway-listen') and leave the rest working.
import net from 'node:net';
import type { Teardown } from './teardown.ts';

interface Forwarded {
  client: net.Socket;
  server: net.Socket;
  /** From the StartupMessage, once it has been read. */
  applicationName: string | undefined;
  silenced: boolean;
  /** The client has ended its side: no longer open, whether or not anything answers. */
  clientEnded: boolean;
}

export interface TcpProxy {
  /** The database URL given, with its host and port replaced by the proxy's. */
  url: string;
  /** Drops every connection, and closes new ones as soon as they open, until restored. */
  cut(): void;
  restore(): void;
  /** Silences the connections open now whose application_name is this; returns how many. */
  blackHole(applicationName: string): number;
  /** The application_name of each connection open now, its client's side not ended (undefined until its startup is read). */
  open(): (string | undefined)[];
  /**
   * Once: calls `then` right after forwarding the next bytes from Postgres to a connection of
   * this application_name (the next that `matches`, when given), in the same callback, so before
   * a client in this process has read them. What `then` writes to the client's socket is read
   * with them.
   */
  afterNextReply(applicationName: string, then: (client: net.Socket) => void, matches?: (reply: Buffer) => boolean): void;
  /**
   * Once: drops the connection of this application_name that Postgres next sends bytes that
   * `matches` to, in place of forwarding them. `dropped` resolves once it has.
   */
  dropNextReply(applicationName: string, matches: (reply: Buffer) => boolean): { dropped: Promise<void> };
}

export async function startTcpProxy(t: Teardown, databaseUrl: string): Promise<TcpProxy> {
  const target = new URL(databaseUrl);
  const connections = new Set<Forwarded>();
  const hooks: { applicationName: string; then: (client: net.Socket) => void; matches: ((reply: Buffer) => boolean) | undefined }[] = [];
  const drops: { applicationName: string; matches: (reply: Buffer) => boolean; dropped: () => void }[] = [];
  let cut = false;
  const drop = (forwarded: Forwarded) => {
    connections.delete(forwarded);
    forwarded.client.destroy();
    forwarded.server.destroy();
  };
  // Half-open sockets, each end passed on as the bytes are: a silenced connection passes on no
  // end either, as a flow a NAT forgot, and whoever ends it waits for an answer that never comes.
  const server = net.createServer({ allowHalfOpen: true }, (client) => {
    if (cut) {
      client.destroy();
      return;
    }
    const upstream = net.connect({ port: Number(target.port || 5432), host: target.hostname, allowHalfOpen: true });
    const forwarded: Forwarded = { client, server: upstream, applicationName: undefined, silenced: false, clientEnded: false };
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
      const dropping = drops.findIndex((entry) => entry.applicationName === forwarded.applicationName && entry.matches(chunk));
      if (dropping >= 0) {
        drop(forwarded);
        drops.splice(dropping, 1)[0]!.dropped();
        return;
      }
      client.write(chunk);
      const hook = hooks.findIndex((entry) => entry.applicationName === forwarded.applicationName && (entry.matches?.(chunk) ?? true));
      if (hook >= 0) hooks.splice(hook, 1)[0]!.then(client);
    });
    client.on('end', () => {
      forwarded.clientEnded = true;
      if (!forwarded.silenced) upstream.end();
    });
    upstream.on('end', () => {
      if (!forwarded.silenced) client.end();
    });
    for (const socket of [client, upstream]) {
      socket.on('error', () => drop(forwarded));
      socket.on('close', () => drop(forwarded));
    }
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  t.teardown(
    () =>
      new Promise<void>((resolve) => {
        for (const forwarded of connections) drop(forwarded);
        server.close(() => resolve());
      }),
  );
  const url = new URL(databaseUrl);
  url.hostname = '127.0.0.1';
  url.port = String((server.address() as net.AddressInfo).port);
  return {
    url: url.toString(),
    cut() {
      cut = true;
      for (const forwarded of connections) drop(forwarded);
    },
    restore() {
      cut = false;
    },
    blackHole(applicationName) {
      let count = 0;
      for (const connection of connections) {
        if (connection.applicationName !== applicationName) continue;
        connection.silenced = true;
        count++;
      }
      return count;
    },
    open: () => [...connections].filter((connection) => !connection.clientEnded).map((connection) => connection.applicationName),
    afterNextReply: (applicationName, then, matches) => void hooks.push({ applicationName, then, matches }),
    dropNextReply(applicationName, matches) {
      const dropped = new Promise<void>((resolve) => drops.push({ applicationName, matches, dropped: resolve }));
      return { dropped };
    },
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
