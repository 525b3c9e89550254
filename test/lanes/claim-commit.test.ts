// A claim commits without waiting for its WAL flush (lanes/repository.ts says why that keeps
// every promise): synchronous_commit is off in the claim's own transaction, and only there.
import { sql } from 'kysely';
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { claimQueueOf, requestRow } from '../helpers/rows.ts';

const synchronousCommit = async (db: Parameters<typeof claimQueueOf>[0]) =>
  (await sql<{ setting: string }>`select current_setting('synchronous_commit') as setting`.execute(db)).rows[0]!.setting;

t.test('a claim commits without waiting for the flush, and leaves the connection as it was', async (t) => {
  const api = await startTestGateway(t, { role: 'api' });
  const client = clientFor(api.url, await api.createKey({ mode: 'live' }));
  const { body } = await client.post({ model: 'gpt-test', messages: userMessage() });
  const id = body.id as string;

  const inClaim = await api.db.connection().execute(async (connection) => {
    // On for this session, whatever the server's default (the suite's embedded server runs without durability).
    await sql`set synchronous_commit = on`.execute(connection);
    const setting = await connection.transaction().execute(async (tx) => {
      const claim = await claimQueueOf(tx, id, 1, 'worker-claiming');
      t.same(claim.started.map((started) => started.id), [id], 'the request is claimed');
      return synchronousCommit(tx);
    });
    t.equal(await synchronousCommit(connection), 'on', 'the next transaction on the connection waits for its flush again');
    return setting;
  });
  t.equal(inClaim, 'off', "the claim's transaction commits without waiting for its flush");
  t.equal((await requestRow(api.db, id))?.status, 'processing', 'the claim is committed');
});
