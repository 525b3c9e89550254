// wait=true across processes and connections: completions reach waiters through NOTIFY, a
// waiter whose client hangs up is dropped, and a shutdown answers every waiter at once.
import http from 'node:http';
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { signature } from '../helpers/signing.ts';

t.test('a waiter in an API process hears a completion made by a worker in another process', async (t) => {
  const api = await startTestGateway(t, { role: 'api', env: { WAIT_TIMEOUT_MS: '10000' } });
  await startTestGateway(t, { role: 'worker', databaseUrl: api.databaseUrl });
  const answer = await clientFor(api.url, await api.createKey()).post({
    model: 'test-delay-200',
    messages: userMessage('across processes'),
    wait: true,
  });
  t.equal(answer.status, 200);
  t.equal(answer.body.choices[0].message.content, 'across processes');
});

t.test('a waiter whose client disconnects is dropped', async (t) => {
  const gateway = await startTestGateway(t, { env: { WAIT_TIMEOUT_MS: '20000', UPSTREAM_TIMEOUT_MS: '10000' } });
  const key = await gateway.createKey();
  const body = JSON.stringify({ model: 'test-delay-5000', messages: userMessage(), wait: true });
  const request = http.request(`${gateway.url}/v1/chat/completions`, {
    method: 'POST',
    headers: {
      authorization: `Bearer ${key.api_key}`,
      'content-type': 'application/json',
      'svc-signature': signature({ secret: key.signing_secret, method: 'POST', path: '/v1/chat/completions', body }),
    },
  });
  request.on('error', () => {});
  request.end(body);
  for (let i = 0; gateway.waiters!.size === 0; i++) {
    if (i > 200) throw new Error('the request never started waiting');
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  t.equal(gateway.waiters!.size, 1, 'waiting');
  request.destroy();
  for (let i = 0; gateway.waiters!.size > 0; i++) {
    if (i > 200) break;
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  t.equal(gateway.waiters!.size, 0, 'dropped once the client is gone');
  const { rows } = await gateway.pool.query('select count(*)::int as count from gateway.requests');
  t.equal(rows[0].count, 1, 'the request itself stays');
});

t.test('shutting down answers waiting requests with their acknowledgement', async (t) => {
  const gateway = await startTestGateway(t, { env: { WAIT_TIMEOUT_MS: '30000', UPSTREAM_TIMEOUT_MS: '60000' } });
  const client = clientFor(gateway.url, await gateway.createKey());
  const pending = client.post({ model: 'test-delay-60000', messages: userMessage(), wait: true });
  for (let i = 0; ; i++) {
    const { rows } = await gateway.pool.query(`select 1 from gateway.requests where status = 'processing'`);
    if (rows.length > 0 && gateway.waiters!.size === 1) break;
    if (i > 500) throw new Error('the request never got under way');
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  const stopped = gateway.stop();
  const answer = await pending;
  t.equal(answer.status, 202);
  t.equal(answer.body.object, 'chat.completion.async');
  t.equal(answer.body.status, 'processing');
  await stopped;
});
