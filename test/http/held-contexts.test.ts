// A wait=true request still waiting is answered outside Koa's middleware chain, and Koa lets go
// of its context at once (http/app.ts, answerLater). Koa has on-finished watch every response,
// and its listener holds the context (with the request's body and ctx.state) until the answer is
// sent; Koa offers no supported way to let go sooner, so app.ts emits 'end' on the response,
// which on-finished takes for the end. Nothing else would notice if that stopped working: this
// holds 10,000 requests at once in an API process (no worker: nothing completes them) and bounds
// the memory each keeps there, after a full collection. Then a shutdown answers every one of
// them with its acknowledgement.
import http from 'node:http';
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { MEMORY_PROBE, readMemoryInUse } from '../helpers/memory-probe.ts';
import { freePort } from '../helpers/ports.ts';
import { serveSettings, spawnServe } from '../helpers/serve.ts';
import { signature } from '../helpers/signing.ts';
import { until, waitFor } from '../helpers/wait.ts';

const HELD = 10_000;
// Sent at once; each wave is stored (and so waiting) before the next is sent.
const WAVE = 500;
const WARM_UP = 500;
// A prompt of a few KiB, as chat requests have: a body that a held context would keep.
const MESSAGE_BYTES = 8 * 1024;
// Measured when this test was written (Node 24, Koa 3.3), per request held: about 8 KiB
// (its socket, its request and response objects, its wait), and about 20 KiB when app.ts does
// not emit 'end' (the context, its Koa request and response, ctx.state with the body's bytes,
// and on-finished's listeners besides).
const KEPT_BYTES_BOUND = 12 * 1024;
const PATH = '/v1/chat/completions';
const KiB = (bytes: number) => `${(bytes / 1024).toFixed(1)} KiB`;

t.test(`${HELD} wait=true requests held at once: the API process keeps none of their Koa contexts`, async (t) => {
  const setup = await startTestGateway(t, { role: 'api' });
  await setup.stop();
  const key = await setup.createKey({ mode: 'test' });
  const port = await freePort();
  const serve = spawnServe(
    t,
    serveSettings(setup, port, { LOG_LEVEL: 'warn', WAIT_TIMEOUT_MS: '600000', ...MEMORY_PROBE.env }),
    ['--role', 'api'],
    MEMORY_PROBE.nodeArgs,
  );
  // One connection per request, as many at once as are held.
  const agent = new http.Agent({ keepAlive: false, maxSockets: Infinity });
  t.teardown(() => agent.destroy());

  const post = (n: number, wait: boolean) =>
    new Promise<number>((resolve, reject) => {
      const content = `${n} ${'x'.repeat(MESSAGE_BYTES)}`;
      const body = JSON.stringify({ model: 'test-hold', messages: [{ role: 'user', content }], wait });
      const request = http.request({
        host: '127.0.0.1',
        port,
        path: PATH,
        method: 'POST',
        agent,
        headers: {
          'content-type': 'application/json',
          'content-length': Buffer.byteLength(body),
          authorization: `Bearer ${key.api_key}`,
          'svc-signature': signature({ secret: key.signing_secret, method: 'POST', path: PATH, body }),
        },
      });
      request.on('response', (response) => {
        response.resume();
        response.on('end', () => resolve(response.statusCode!));
      });
      request.on('error', reject);
      request.end(body);
    });
  const stored = async () => Number((await setup.pool.query<{ count: string }>('select count(*) from gateway.requests')).rows[0]!.count);

  await until(async () => (await post(-1, false).catch(() => 0)) === 202, () => `the API process:\n${serve.output()}`, 15_000);
  // Its code compiled and its pools filled before its memory is read.
  for (let sent = 0; sent < WARM_UP; sent += 50) {
    const statuses = await Promise.all(Array.from({ length: 50 }, (_, i) => post(-(sent + i), false)));
    if (statuses.some((status) => status !== 202)) throw new Error(`warm-up answered ${statuses.join(', ')}`);
  }
  const before = await readMemoryInUse(serve);
  const storedBefore = await stored();

  const started = performance.now();
  const held: Promise<number>[] = [];
  while (held.length < HELD) {
    for (let i = 0; i < WAVE; i++) held.push(post(held.length, true));
    const sent = held.length;
    if (!(await waitFor(async () => (await stored()) - storedBefore >= sent, 60_000, 100))) {
      throw new Error(`${sent} sent were not all stored within a minute; the API process:\n${serve.output().slice(-2_000)}`);
    }
  }
  // Stored is waiting: the answer's promise is set, and the chain ended, in the same turn.
  await new Promise((resolve) => setTimeout(resolve, 500));
  const during = await readMemoryInUse(serve);
  const kept = (during - before) / HELD;
  t.comment(
    `${HELD} held in ${((performance.now() - started) / 1000).toFixed(1)} s; memory in use after a full collection ` +
      `${(before / 2 ** 20).toFixed(1)} MiB before, ${(during / 2 ** 20).toFixed(1)} MiB with them held: ${KiB(kept)} each`,
  );
  t.ok(kept < KEPT_BYTES_BOUND, `a held request keeps ${KiB(kept)}, under ${KiB(KEPT_BYTES_BOUND)}`);

  // The shutdown answers the waiting requests with their acknowledgement, outside Koa as ever.
  const exited = serve.kill('SIGTERM');
  const statuses = await Promise.all(held.map((answer) => answer.catch(() => 0)));
  t.equal(statuses.filter((status) => status === 202).length, HELD, 'every held request is answered 202 at shutdown');
  t.equal((await exited)?.code, 0, 'and the API process exits cleanly');
  t.notMatch(serve.output(), /"level":(50|60)/, 'having logged no error');
});
