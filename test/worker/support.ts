// What the tests of the rescues share (rescue.test.ts, stalled-jobs.test.ts): requests accepted
// with no worker to run them, and the jobs that would serve them lost.
import type { TestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { queueOf } from '../helpers/rows.ts';

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
