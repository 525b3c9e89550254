// Nonces against clock skew: an API process whose clock is behind the database's accepts a
// signature by its own clock, while the nonce is deleted by the database's. The nonce must
// outlive every moment the API would still accept the signature.
import t from 'tap';
import { deleteExpiredNonces } from '../../src/keys/repository.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { send, userMessage } from '../helpers/http.ts';
import { freePort } from '../helpers/ports.ts';
import { serveSettings, spawnServe } from '../helpers/serve.ts';
import { signature } from '../helpers/signing.ts';
import { until } from '../helpers/wait.ts';

const SKEW_MS = -295_000;

t.test('an API clock 295 s behind the database: a replay inside the signature window is refused, even after the nonce cleanup', async (t) => {
  const setup = await startTestGateway(t, { role: 'api' });
  await setup.stop();
  const key = await setup.createKey();
  const port = await freePort();
  const skewed = new URL('../helpers/skewed-clock.ts', import.meta.url).pathname;
  const api = spawnServe(
    t,
    serveSettings(setup, port, {
      NODE_OPTIONS: `--import ${skewed}`,
      TEST_CLOCK_OFFSET_MS: String(SKEW_MS),
    }),
    ['--role', 'api'],
  );
  await until(() => api.output().includes('gateway started'), () => `the API:\n${api.output()}`, 15_000);
  const url = `http://127.0.0.1:${port}`;

  // Signed by the API's clock (a client synchronised with it).
  const body = JSON.stringify({ model: 'test-echo', messages: userMessage() });
  const header = signature({
    secret: key.signing_secret,
    method: 'POST',
    path: '/v1/chat/completions',
    body,
    timestamp: Math.floor((Date.now() + SKEW_MS) / 1000),
  });
  const post = () => send(url, { path: '/v1/chat/completions', body, key: key.api_key, headers: { 'svc-signature': header } });
  t.equal((await post()).status, 202, 'accepted by the API\'s clock');

  // Past the signature's timestamp + 301 s by the database's clock, the cleanup task runs.
  await new Promise((resolve) => setTimeout(resolve, 7_000));
  await deleteExpiredNonces(setup.db, 1_000);
  const replay = await post();
  t.equal(replay.status, 401, 'the replay, still inside the API\'s window, is refused');
  t.equal(replay.body.error.code, 'replayed_request');
  const { rows } = await setup.pool.query('select count(*)::int as count from gateway.requests');
  t.equal(rows[0].count, 1, 'one request stored');
});
