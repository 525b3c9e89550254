// What the webhook tests share: a receiver on loopback scripted by the test (which can verify
// every delivery with the official standardwebhooks package), requests made terminal straight
// in the database (so that gateway.enqueue_webhooks writes their messages), a deliverer built
// directly on a test database, and a stand-in for graphile-worker that runs the webhook jobs
// that are due (deliver_webhook, wake_webhook_endpoint).
import { randomBytes } from 'node:crypto';
import http from 'node:http';
import { Writable } from 'node:stream';
import { sql } from 'kysely';
import { Webhook } from 'standardwebhooks';
import type { Config } from '../../src/config.ts';
import type { Db } from '../../src/db/pool.ts';
import type { CreatedKey } from '../../src/keys/service.ts';
import { createLogger } from '../../src/logger.ts';
import { Metrics } from '../../src/metrics.ts';
import { WebhookDeliverer } from '../../src/webhooks/deliverer.ts';
import { addEndpoint, type CreatedEndpoint } from '../../src/webhooks/endpoints.ts';
import type { TestGateway } from '../helpers/gateway.ts';
import { plantRequest } from '../helpers/populate.ts';
import { listenOnLoopback } from '../helpers/ports.ts';
import type { Teardown } from '../helpers/teardown.ts';

export interface Delivery {
  /** 1-based, in the order received. */
  count: number;
  receivedAt: number;
  path: string;
  headers: http.IncomingHttpHeaders;
  /** The raw body, as received. */
  body: string;
  /** Which of the receiver's secrets verified it with standardwebhooks (indexes); empty when none did. */
  verifiedWith: number[];
  /** The parsed body, when it verified. */
  event: { type: string; timestamp: string; data: Record<string, unknown> } | undefined;
}

export type ReceiverReply =
  | { status: number; headers?: Record<string, string>; body?: string }
  /** Never answers (the deliverer's timeout, or its shutdown, ends it). */
  | { hang: true }
  /** Drops the connection without an answer. */
  | { reset: true }
  /** Sends its status line and the start of a body, and never ends it. */
  | { status: number; unfinished: true };

export interface Receiver {
  url: string;
  port: number;
  deliveries: Delivery[];
  /** The secrets it verifies with (assign after adding the endpoint); each delivery records which verified it. */
  secrets: string[];
  /** Connections accepted, requests or not. */
  connections: number;
  /** Deliveries received and not yet answered (nor dropped): now, and at most so far. */
  open: number;
  maxOpen: number;
  /** Answers every delivery still hanging, and any later one, with this. */
  release(reply: ReceiverReply): void;
  close(): Promise<void>;
}

/** An HTTP receiver on 127.0.0.1; `reply` answers each delivery (default 204). */
export async function startReceiver(
  t: Teardown,
  reply: (delivery: Delivery) => ReceiverReply | Promise<ReceiverReply> = () => ({ status: 204 }),
): Promise<Receiver> {
  const deliveries: Delivery[] = [];
  const hanging: ((reply: ReceiverReply) => void)[] = [];
  let released: ReceiverReply | undefined;
  const receiver: Receiver = {
    url: '',
    port: 0,
    deliveries,
    secrets: [],
    connections: 0,
    open: 0,
    maxOpen: 0,
    release(answer) {
      released = answer;
      for (const answerOne of hanging.splice(0)) answerOne(answer);
    },
    close: async () => {},
  };
  const server = http.createServer(async (request, response) => {
    receiver.open++;
    receiver.maxOpen = Math.max(receiver.maxOpen, receiver.open);
    response.on('close', () => receiver.open--);
    const chunks: Buffer[] = [];
    for await (const chunk of request) chunks.push(chunk as Buffer);
    const body = Buffer.concat(chunks).toString('utf8');
    const delivery: Delivery = {
      count: deliveries.length + 1,
      receivedAt: Date.now(),
      path: request.url ?? '',
      headers: request.headers,
      body,
      verifiedWith: [],
      event: undefined,
    };
    receiver.secrets.forEach((secret, index) => {
      try {
        delivery.event = new Webhook(secret).verify(body, request.headers as Record<string, string>) as Delivery['event'];
        delivery.verifiedWith.push(index);
      } catch {}
    });
    deliveries.push(delivery);
    let answer = released ?? (await reply(delivery));
    if ('hang' in answer) {
      answer = await new Promise<ReceiverReply>((resolve) => hanging.push(resolve));
      if ('hang' in answer) return;
    }
    if ('reset' in answer) {
      request.socket.destroy();
      return;
    }
    if ('unfinished' in answer) {
      response.writeHead(answer.status, { 'content-type': 'application/json' });
      response.write('{"received":');
      return;
    }
    response.writeHead(answer.status, answer.headers);
    response.end(answer.body ?? '');
  });
  server.on('connection', () => receiver.connections++);
  const port = await listenOnLoopback(t, server);
  receiver.port = port;
  receiver.url = `http://127.0.0.1:${port}/hooks`;
  receiver.close = () =>
    new Promise<void>((resolve) => {
      server.closeAllConnections();
      server.close(() => resolve());
    });
  return receiver;
}

/** An endpoint added as `gateway webhooks add` does (http:// and loopback allowed). */
export async function addTestEndpoint(
  gateway: Pick<TestGateway, 'db' | 'config'>,
  options: { project?: string; url: string; events?: string[] },
): Promise<CreatedEndpoint> {
  return addEndpoint(
    gateway.db,
    { encryptionKey: gateway.config.secretEncryptionKeys[0], allowPrivate: true },
    { project: options.project ?? 'test-project', url: options.url, ...(options.events ? { events: options.events } : {}) },
  );
}

/**
 * A request of the key's project that ends now with `status`, as a worker would end it: the
 * trigger writes a message for each endpoint that takes the event, and its deliver_webhook job.
 */
export async function endRequest(
  gateway: TestGateway,
  key: CreatedKey,
  status: 'completed' | 'failed' | 'cancelled',
): Promise<string> {
  const planted = await plantRequest(gateway, key, { status: 'processing', attempts: [{ outcome: 'running' }] });
  const completion = { id: `chatcmpl-${randomBytes(6).toString('hex')}`, object: 'chat.completion', choices: [], usage: { prompt_tokens: 1, completion_tokens: 2, total_tokens: 3 } };
  await gateway.pool.query(
    `update gateway.requests
     set status = $2, result = $3::json, last_error_code = $4, finished_at = now(), updated_at = now()
     where id = $1`,
    [
      planted.id,
      status,
      status === 'completed' ? JSON.stringify(completion) : null,
      status === 'failed' ? 'upstream_bad_request' : null,
    ],
  );
  return planted.id;
}

export async function messagesOf(db: Db, requestId?: string) {
  let query = db.selectFrom('webhook_messages').selectAll().orderBy('created_at').orderBy('id');
  if (requestId !== undefined) query = query.where('request_id', '=', requestId);
  return query.execute();
}

export async function triesOf(db: Db, messageId: string) {
  return db.selectFrom('webhook_deliveries').selectAll().where('message_id', '=', messageId).orderBy('try_number').execute();
}

/** The deliver_webhook jobs in the queue (graphile-worker's jobs view does not show payloads). */
export async function deliveryJobs(
  db: Db,
): Promise<{ message_id: string; endpoint_id: string | null; run_at: Date; locked_by: string | null }[]> {
  const { rows } = await sql<{ message_id: string; endpoint_id: string | null; run_at: Date; locked_by: string | null }>`
    select jobs.payload->>'message_id' as message_id, jobs.payload->>'endpoint_id' as endpoint_id, jobs.run_at, jobs.locked_by
    from graphile_worker._private_jobs as jobs
    join graphile_worker._private_tasks as tasks on tasks.id = jobs.task_id
    where tasks.identifier = 'deliver_webhook'
    order by jobs.run_at, jobs.id
  `.execute(db);
  return rows;
}

/** The wake_webhook_endpoint jobs in the queue. */
export async function wakeJobs(db: Db): Promise<{ endpoint_id: string; deferrals: number; run_at: Date; key: string | null }[]> {
  const { rows } = await sql<{ endpoint_id: string; deferrals: number; run_at: Date; key: string | null }>`
    select jobs.payload->>'endpoint_id' as endpoint_id, (jobs.payload->>'deferrals')::int as deferrals, jobs.run_at, jobs.key
    from graphile_worker._private_jobs as jobs
    join graphile_worker._private_tasks as tasks on tasks.id = jobs.task_id
    where tasks.identifier = 'wake_webhook_endpoint'
    order by jobs.run_at, jobs.id
  `.execute(db);
  return rows;
}

export type DueJob =
  | { task: 'deliver_webhook'; message_id: string; endpoint_id: string | undefined }
  | { task: 'wake_webhook_endpoint'; endpoint_id: string; deferrals: number };

/**
 * Takes the webhook jobs that are due out of the queue, as graphile-worker would (deliver_webhook
 * and wake_webhook_endpoint), in the order it would run them.
 */
export async function takeDueWebhookJobs(db: Db): Promise<DueJob[]> {
  const { rows } = await sql<{ task: string; payload: Record<string, unknown> }>`
    with taken as (
      delete from graphile_worker._private_jobs as jobs
      using graphile_worker._private_tasks as tasks
      where tasks.id = jobs.task_id and tasks.identifier in ('deliver_webhook', 'wake_webhook_endpoint') and jobs.run_at <= now()
      returning jobs.id, jobs.run_at, tasks.identifier as task, jobs.payload
    )
    select task, payload from taken order by run_at, id
  `.execute(db);
  return rows.map((row) =>
    row.task === 'deliver_webhook'
      ? { task: 'deliver_webhook', message_id: String(row.payload.message_id), endpoint_id: row.payload.endpoint_id as string | undefined }
      : { task: 'wake_webhook_endpoint', endpoint_id: String(row.payload.endpoint_id), deferrals: Number(row.payload.deferrals ?? 0) },
  );
}

export interface TestDeliverer {
  deliverer: WebhookDeliverer;
  metrics: Metrics;
  /** Every log line it wrote, parsed. */
  logs: Record<string, any>[];
  /** Runs the webhook jobs that are due (deliveries and wakes); returns what deliver() or wake() said for each. */
  runDueJobs(): Promise<string[]>;
}

/**
 * A WebhookDeliverer on the gateway's database, as main.ts builds it, with these settings over
 * quick ones (loopback allowed, 100/200/400 ms retries); stopped at teardown.
 */
export function testDeliverer(
  t: Teardown,
  gateway: Pick<TestGateway, 'db' | 'config'>,
  options: {
    webhooks?: Partial<Config['webhooks']>;
    secretEncryptionKey?: Buffer | undefined;
    shutdownGraceMs?: number;
    workerId?: string;
  } = {},
): TestDeliverer {
  const logs: Record<string, any>[] = [];
  const sink = new Writable({
    write(chunk: Buffer, _encoding, done) {
      for (const line of chunk.toString('utf8').split('\n').filter(Boolean)) logs.push(JSON.parse(line));
      done();
    },
  });
  // Every scrape reads the database: a test reads the gauges as they change.
  const metrics = new Metrics({ databaseGaugeTtlMs: 0 });
  const deliverer = new WebhookDeliverer({
    db: gateway.db,
    config: {
      webhooks: {
        allowPrivate: true,
        timeoutMs: 2_000,
        retryScheduleMs: [100, 200, 400],
        maxInFlight: 100,
        maxInFlightPerEndpoint: 10,
        ...options.webhooks,
      },
      secretEncryptionKeys:
        'secretEncryptionKey' in options
          ? options.secretEncryptionKey
            ? [options.secretEncryptionKey]
            : []
          : gateway.config.secretEncryptionKeys,
      shutdownGraceMs: options.shutdownGraceMs ?? 1_000,
    },
    workerId: options.workerId ?? `worker-test-${randomBytes(4).toString('hex')}`,
    metrics,
    logger: createLogger({ logLevel: 'debug' }, sink),
  });
  t.teardown(() => deliverer.stop());
  return {
    deliverer,
    metrics,
    logs,
    async runDueJobs() {
      const jobs = await takeDueWebhookJobs(gateway.db);
      return Promise.all(
        jobs.map((job) =>
          job.task === 'deliver_webhook' ? deliverer.deliver(job.message_id, job.endpoint_id) : deliverer.wake(job.endpoint_id, job.deferrals),
        ),
      );
    },
  };
}

/** The value of one sample of the metrics exposition ("name{labels}"), 0 when absent. */
export async function metricValue(metrics: Metrics, sample: string): Promise<number> {
  for (const line of (await metrics.render()).split('\n')) {
    if (line.startsWith('#')) continue;
    const at = line.lastIndexOf(' ');
    if (line.slice(0, at) === sample) return Number(line.slice(at + 1));
  }
  return 0;
}

/** The data of a delivery's body, as the text it carries (the body is `{"type",...,"data":<record>}`). */
export function dataText(body: string): string {
  const at = body.indexOf(',"data":');
  return at === -1 ? '' : body.slice(at + ',"data":'.length, -1);
}
