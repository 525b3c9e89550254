// A webhook receiver for the fault scenarios, as a customer would run one: it verifies every
// delivery with the official standardwebhooks package and answers 204. It can go down (it stops
// listening: connections are refused) and come back on the same port.
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { Webhook } from 'standardwebhooks';
import type { Teardown } from '../../helpers/teardown.ts';

export interface ReceivedDelivery {
  id: string;
  receivedAt: number;
  verified: boolean;
  /** The parsed body, once verified. */
  event: { type: string; timestamp: string; data: { id: string; status: string } } | undefined;
}

export interface WebhookReceiver {
  url: string;
  deliveries: ReceivedDelivery[];
  /** The endpoint's secret, once known: every delivery is verified with it. */
  secret: string | undefined;
  /** Stops listening and drops every connection: tries meet a refused connection. */
  down(): Promise<void>;
  /** Listens again, on the same port. */
  up(): Promise<void>;
}

export async function startWebhookReceiver(t: Teardown): Promise<WebhookReceiver> {
  const deliveries: ReceivedDelivery[] = [];
  const receiver: WebhookReceiver = { url: '', deliveries, secret: undefined, down: async () => {}, up: async () => {} };
  const server = http.createServer(async (request, response) => {
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    const body = Buffer.concat(chunks).toString('utf8');
    const delivery: ReceivedDelivery = { id: String(request.headers['webhook-id']), receivedAt: Date.now(), verified: false, event: undefined };
    try {
      delivery.event = new Webhook(receiver.secret ?? 'whsec_AAAA').verify(body, request.headers as Record<string, string>) as ReceivedDelivery['event'];
      delivery.verified = true;
    } catch {}
    deliveries.push(delivery);
    response.writeHead(delivery.verified ? 204 : 400).end();
  });
  const listen = (port: number) => new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, '127.0.0.1', () => {
      server.off('error', reject);
      resolve();
    });
  });
  await listen(0);
  const { port } = server.address() as AddressInfo;
  receiver.url = `http://127.0.0.1:${port}/webhooks`;
  receiver.down = () =>
    new Promise<void>((resolve) => {
      server.close(() => resolve());
      server.closeAllConnections();
    });
  receiver.up = () => listen(port);
  t.teardown(() => (server.listening ? receiver.down() : undefined));
  return receiver;
}
