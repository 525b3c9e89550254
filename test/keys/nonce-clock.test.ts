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

t.test("two API processes whose clocks disagree by 200 s: a replay to the one behind, inside its window, is refused after 700 s", async (t) => {
  const setup = await startTestGateway(t, { role: 'api' });
  await setup.stop();
  const key = await setup.createKey();
  const skewed = new URL('../helpers/skewed-clock.ts', import.meta.url).pathname;
  const start = async (offsetMs: number) => {
    const port = await freePort();
    const api = spawnServe(t, serveSettings(setup, port, { NODE_OPTIONS: `--import ${skewed}`, TEST_CLOCK_OFFSET_MS: String(offsetMs) }), ['--role', 'api']);
    await until(() => api.output().includes('gateway started'), () => `the API:\n${api.output()}`, 15_000);
    return `http://127.0.0.1:${port}`;
  };
  // 700 s are simulated rather than waited for: the nonce's expiry is moved 700 s nearer, and the
  // second process's clock runs as it would 700 s from now, 200 s behind the first's.
  const SIMULATED_S = 700;
  const BEHIND_S = 200;
  const first = await start(0);
  const second = await start((SIMULATED_S - BEHIND_S) * 1000);

  // A client whose clock is 290 s ahead of the first process's: inside its window.
  const body = JSON.stringify({ model: 'test-echo', messages: userMessage() });
  const timestamp = Math.floor(Date.now() / 1000) + 290;
  const header = signature({ secret: key.signing_secret, method: 'POST', path: '/v1/chat/completions', body, timestamp });
  const post = (url: string) => send(url, { path: '/v1/chat/completions', body, key: key.api_key, headers: { 'svc-signature': header } });
  t.equal((await post(first)).status, 202, 'accepted by the first');

  await setup.pool.query(`update gateway.signature_nonces set expires_at = expires_at - interval '${SIMULATED_S} seconds'`);
  t.equal(await deleteExpiredNonces(setup.db, 1_000), 0, 'the cleanup task keeps the nonce');
  const replay = await post(second);
  t.equal(replay.status, 401, 'the replay to the second, whose clock still has the signature in its window, is refused');
  t.equal(replay.body.error?.code, 'replayed_request', 'as a replay');
  const { rows } = await setup.pool.query('select count(*)::int as count from gateway.requests');
  t.equal(rows[0].count, 1, 'one request stored');
});
