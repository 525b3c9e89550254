// What the tests of the rescues and of jobs share (rescue.test.ts, stalled-jobs.test.ts,
// spent-jobs.test.ts): requests accepted with no worker to run them, an event for a receiver with
// no worker to deliver it, and the jobs that would serve them lost.
import type { Test } from 'tap';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { queueOf } from '../helpers/rows.ts';
import { addTestEndpoint, endRequest, startReceiver } from '../webhooks/support.ts';

/** The webhook tasks, whose jobs loseJobs forgets for an endpoint's messages to wait with none. */
export const WEBHOOK_TASKS = ['deliver_webhook', 'wake_webhook_endpoint'];

/** Accepts one request of `model` (no worker runs it); returns its id and its queue's. */
export async function accept(gateway: TestGateway, key: Awaited<ReturnType<TestGateway['createKey']>>, model: string) {
  const answer = await clientFor(gateway.url, key).post({ model, messages: userMessage() });
  const id = (answer.body as { id: string }).id;
  return { id, queueId: await queueOf(gateway.db, id) };
}

/** Forgets every job of these tasks: the wake-ups they were are lost. */
export async function loseJobs(gateway: TestGateway, tasks: string[] = ['dispatch_queue']): Promise<void> {
  await gateway.pool.query(
    `delete from graphile_worker._private_jobs
     where task_id in (select id from graphile_worker._private_tasks where identifier = any($1::text[]))`,
    [tasks],
  );
}

/**
 * An API process (no worker), a receiver and its endpoint, and a request ended (completed): its
 * event waits for a worker to deliver it.
 */
export async function eventForReceiver(t: Test) {
  const api = await startTestGateway(t, { role: 'api' });
  const receiver = await startReceiver(t);
  const endpoint = await addTestEndpoint(api, { url: receiver.url });
  receiver.secrets.push(endpoint.secret);
  const requestId = await endRequest(api, await api.createKey(), 'completed');
  return { api, receiver, endpoint, requestId };
}
