// API_PROCESSES > 1: several API processes share the port, the primary runs the worker, a
// scrape of /metrics counts every process (on the primary's METRICS_PORT, or through any API
// process with METRICS_TOKEN), a killed API process is replaced, and SIGTERM stops them all
// cleanly; an API process that cannot start fails the start rather than being replaced.
import net from 'node:net';
import t from 'tap';
import { startTestGateway } from './helpers/gateway.ts';
import { clientFor, send, userMessage } from './helpers/http.ts';
import { freePort } from './helpers/ports.ts';
import { serveSettings, spawnServe } from './helpers/serve.ts';
import { until } from './helpers/wait.ts';

// Starting the processes is loading their modules: seconds of CPU each, more while other test
// files run beside this one.
const STARTED_WITHIN_MS = 30_000;

t.test('two API processes and a worker, started by one gateway serve', async (t) => {
  const setup = await startTestGateway(t, { role: 'api' });
  await setup.stop();
  const key = await setup.createKey();
  const port = await freePort();
  const metricsPort = await freePort();
  const serve = spawnServe(t, serveSettings(setup, port, {
    METRICS_PORT: String(metricsPort),
    API_PROCESSES: '2',
    LOG_LEVEL: 'info',
  }));
  const { output } = serve;
  const waitUntil = (condition: () => boolean, what: string) =>
    until(condition, () => `${what}:\n${output()}`, STARTED_WITHIN_MS);
  const pidsOf = (message: string) =>
    output()
      .split('\n')
      .filter((line) => line.includes(`"msg":"${message}"`))
      .map((line) => JSON.parse(line).pid as number);
  await waitUntil(() => output().includes('API processes listening'), 'the API processes');

  const url = `http://127.0.0.1:${port}`;
  const client = clientFor(url, key);
  const answers = await Promise.all(
    Array.from({ length: 20 }, (_, i) => client.post({ model: 'test-echo', messages: userMessage(`n${i}`), wait: true })),
  );
  t.same(new Set(answers.map((answer) => answer.status)), new Set([200]), 'all 20 completed through the cluster');
  const apiPids = pidsOf('gateway started').filter((pid) => pid !== serve.pid);
  t.equal(new Set(apiPids).size, 2, 'two API processes started');
  const servedBy = output()
    .split('\n')
    .filter((line) => line.includes('"route":"/v1/chat/completions"'))
    .map((line) => JSON.parse(line).pid as number);
  t.same([...new Set(servedBy)].sort(), [...new Set(apiPids)].sort(), 'both served some of them');

  const metrics = (await send(`http://127.0.0.1:${metricsPort}`, { path: '/metrics' })).text;
  t.match(metrics, /gateway_requests_accepted_total\{mode="test"\} 20\n/, 'the primary\'s METRICS_PORT counts the requests of both processes');
  t.match(metrics, /gateway_attempts_total\{mode="test",outcome="succeeded",code="none"\} 20\n/, 'and the worker\'s attempts');
  t.equal((await send(url, { path: '/metrics' })).status, 404, 'the API processes serve none on PORT');

  // A killed API process is replaced; the service keeps answering.
  process.kill(apiPids[0]!, 'SIGKILL');
  await waitUntil(() => output().includes('an API process exited; starting another'), 'the replacement');
  await waitUntil(() => pidsOf('gateway started').filter((pid) => pid !== serve.pid).length === 3, 'a third API process');
  const after = await client.post({ model: 'test-echo', messages: userMessage('after'), wait: true });
  t.equal(after.status, 200);

  t.equal((await serve.kill('SIGTERM'))?.code, 0, 'exits 0 on SIGTERM');
  t.equal(pidsOf('shut down cleanly').length, 3, 'the primary and both API processes shut down cleanly');
});

t.test('METRICS_TOKEN without METRICS_PORT: any API process answers /metrics for all, behind the token', async (t) => {
  const setup = await startTestGateway(t, { role: 'api' });
  await setup.stop();
  const key = await setup.createKey();
  const port = await freePort();
  const serve = spawnServe(t, serveSettings(setup, port, {
    METRICS_TOKEN: 'cluster-scrape-token',
    API_PROCESSES: '2',
    LOG_LEVEL: 'info',
  }), ['--role', 'api']);
  await until(() => serve.output().includes('API processes listening'), () => `the API processes:\n${serve.output()}`, STARTED_WITHIN_MS);
  const url = `http://127.0.0.1:${port}`;
  const client = clientFor(url, key);
  /** The pids of the API processes that answered `route` with `status`, from their log lines. */
  const answeredBy = (route: string, status: number) =>
    new Set(
      serve
        .output()
        .split('\n')
        .filter((line) => line.includes(`"route":"${route}"`) && line.includes(`"status":${status}`))
        .map((line) => JSON.parse(line).pid as number),
    );
  // At once, so on several connections, which the cluster hands to its processes in turn.
  const accepted = await Promise.all(
    Array.from({ length: 10 }, (_, i) => client.post({ model: 'test-echo', messages: userMessage(`n${i}`) })),
  );
  t.same(accepted.map((answer) => answer.status), Array(10).fill(202));
  t.equal(answeredBy('/v1/chat/completions', 202).size, 2, 'both API processes accepted some');

  t.equal((await send(url, { path: '/metrics' })).status, 401, 'the token is required');
  const scrapes = await Promise.all(
    Array.from({ length: 8 }, () => send(url, { path: '/metrics', headers: { authorization: 'Bearer cluster-scrape-token' } })),
  );
  for (const [i, metrics] of scrapes.entries()) {
    t.equal(metrics.status, 200);
    t.match(metrics.text, /gateway_requests_accepted_total\{mode="test"\} 10\n/, `scrape ${i + 1}: all 10`);
  }
  t.equal(answeredBy('/metrics', 200).size, 2, 'answered by both API processes, each counting the other\'s');
  t.equal((await serve.kill('SIGTERM'))?.code, 0);
});

t.test('an API process that cannot start stops the start: the others stopped, exit 1, none replaced', async (t) => {
  const setup = await startTestGateway(t, { role: 'api' });
  await setup.stop();
  // A permanent failure: PORT is held by a plain server.
  const holder = net.createServer();
  await new Promise<void>((resolve) => holder.listen(0, '127.0.0.1', resolve));
  t.teardown(() => new Promise<void>((resolve) => holder.close(() => resolve())));
  const port = (holder.address() as net.AddressInfo).port;
  const serve = spawnServe(t, serveSettings(setup, port, { API_PROCESSES: '2', LOG_LEVEL: 'info' }));
  const exit = await Promise.race([
    serve.exited(),
    new Promise<undefined>((resolve) => setTimeout(() => resolve(undefined), STARTED_WITHIN_MS).unref()),
  ]);
  t.ok(exit, `exits within ${STARTED_WITHIN_MS} ms`, { output: serve.output() });
  t.equal(exit?.code, 1, 'with code 1');
  t.match(serve.output(), `An API process could not start: bind EADDRINUSE 127.0.0.1:${port}`);
  t.notMatch(serve.output(), 'starting another', 'no API process is replaced');
  t.notMatch(serve.output(), 'API processes listening');
});

t.test('SIGTERM while an API process that exited waits for its replacement: none is started during the shutdown', async (t) => {
  const setup = await startTestGateway(t, { role: 'api' });
  await setup.stop();
  const key = await setup.createKey();
  const port = await freePort();
  // A call in flight holds the primary's worker, and so its shutdown, for seconds: long after
  // the replacement would be due.
  const serve = spawnServe(t, serveSettings(setup, port, { API_PROCESSES: '2', LOG_LEVEL: 'info', SHUTDOWN_GRACE_MS: '6000' }));
  const { output } = serve;
  const primary = serve.pid;
  /** The API processes that logged `message`. */
  const pidsOf = (message: string) =>
    output()
      .split('\n')
      .filter((line) => line.includes(`"msg":"${message}"`))
      .map((line) => JSON.parse(line).pid as number)
      .filter((pid) => pid !== primary);
  await until(() => output().includes('API processes listening'), () => `the API processes:\n${output()}`, STARTED_WITHIN_MS);
  const client = clientFor(`http://127.0.0.1:${port}`, key);
  const accepted = await client.post({ model: 'test-delay-4000', messages: userMessage() });
  t.equal(accepted.status, 202);
  const id = (accepted.body as { id: string }).id;
  await until(async () => ((await client.get(id)).body as { status: string }).status === 'processing', 'the call to start');

  // Both at once: their replacements are due 250 ms and 500 ms or so after their exits.
  const killed = pidsOf('gateway started');
  for (const pid of killed) process.kill(pid, 'SIGKILL');
  await until(() => output().includes('an API process exited; starting another'), () => `the exits:\n${output()}`);
  serve.signal('SIGTERM');
  t.equal((await serve.exited()).code, 0, 'the primary exits 0');
  // One forked before the signal is stopped with the others (it drains, or it ends before it
  // has started); one forked after it would serve until the primary's exit cut it off.
  const replacements = pidsOf('gateway started').filter((pid) => !killed.includes(pid));
  const drained = pidsOf('shut down cleanly');
  t.same(replacements.filter((pid) => !drained.includes(pid)), [], 'no API process served during the shutdown without being drained', { output: output() });
});

t.test('METRICS_PORT in use stops the start: the API processes already listening are stopped in order, exit 1', async (t) => {
  const setup = await startTestGateway(t, { role: 'api' });
  await setup.stop();
  const holder = net.createServer();
  await new Promise<void>((resolve) => holder.listen(0, '127.0.0.1', resolve));
  t.teardown(() => new Promise<void>((resolve) => holder.close(() => resolve())));
  const metricsPort = (holder.address() as net.AddressInfo).port;
  const serve = spawnServe(t, serveSettings(setup, await freePort(), { API_PROCESSES: '2', METRICS_PORT: String(metricsPort), LOG_LEVEL: 'info' }));
  const primary = serve.pid;
  const exit = await Promise.race([
    serve.exited(),
    new Promise<undefined>((resolve) => setTimeout(() => resolve(undefined), STARTED_WITHIN_MS).unref()),
  ]);
  t.equal(exit?.code, 1, 'it exits 1', { output: serve.output() });
  t.match(serve.output(), `listen EADDRINUSE: address already in use 127.0.0.1:${metricsPort}`);
  const pidsOf = (message: string) =>
    serve.output().split('\n').filter((line) => line.includes(`"msg":"${message}"`)).map((line) => JSON.parse(line).pid as number);
  const apiProcesses = pidsOf('gateway started').filter((pid) => pid !== primary);
  t.equal(apiProcesses.length, 2, 'both API processes had started');
  t.same(pidsOf('shut down cleanly').filter((pid) => pid !== primary).sort(), apiProcesses.sort(), 'and both shut down cleanly');
});
