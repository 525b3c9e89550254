// Keep-alive connections and a process held off the CPU: on a busy host, a gateway process can
// go seconds without running. A client reuses its idle connection meanwhile; the process, as it
// wakes, runs its timers before it reads its sockets, and a keep-alive timeout that expired in
// the pause would close that connection with the request unread: the client would get a reset.
// The process is held here with SIGSTOP, as the kernel holds a starved one. And a server that
// keeps idle connections that long must close them itself as it shuts down, after the answers
// still being sent on them.
import http from 'node:http';
import net from 'node:net';
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { closeServer, KEEP_ALIVE_TIMEOUT_MS, listen } from '../../src/http/server.ts';
import { startTestGateway } from '../helpers/gateway.ts';
import { clientFor, userMessage } from '../helpers/http.ts';
import { apiProcess } from '../helpers/serve.ts';
import { until } from '../helpers/wait.ts';

// Longer than the keep-alive timeouts of Node's own servers (5 s), shorter than the gateway's.
const PAUSE_MS = 6_000;

t.test(`a request sent on an idle keep-alive connection while the API process is paused for ${PAUSE_MS / 1000} s is answered, not reset`, async (t) => {
  const api = await apiProcess(t);
  await api.start();

  // One connection, kept: the second request goes on the first one's connection.
  const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  t.teardown(() => agent.destroy());
  const healthz = () =>
    new Promise<{ status: number; reused: boolean; keepAlive: string | undefined } | { failure: string }>((resolve) => {
      const request = http.get(`${api.url}/healthz`, { agent }, (response) => {
        response.resume();
        response.on('end', () => resolve({ status: response.statusCode!, reused: request.reusedSocket, keepAlive: response.headers['keep-alive'] as string | undefined }));
      });
      request.on('error', (error: NodeJS.ErrnoException) => resolve({ failure: error.code ?? error.message }));
    });

  const seconds = KEEP_ALIVE_TIMEOUT_MS / 1000;
  t.same(await healthz(), { status: 200, reused: false, keepAlive: `timeout=${seconds}` }, `the first request opens the connection, kept ${seconds} s`);
  t.ok(KEEP_ALIVE_TIMEOUT_MS > PAUSE_MS + 1_000, 'longer than the pause');
  const idleSince = Date.now();
  api.signal('SIGSTOP');
  t.teardown(() => api.signal('SIGCONT'));
  await sleep(1_000);
  const second = healthz();
  await sleep(idleSince + PAUSE_MS - Date.now());
  api.signal('SIGCONT');
  t.same(await second, { status: 200, reused: true, keepAlive: `timeout=${seconds}` }, 'the second, sent on it during the pause, is answered once the process runs again');
});

t.test('a stopping API answers the requests it holds with Connection: close, so that their connections end with them', async (t) => {
  const gateway = await startTestGateway(t, { env: { WAIT_TIMEOUT_MS: '30000', UPSTREAM_TIMEOUT_MS: '60000' } });
  const client = clientFor(gateway.url, await gateway.createKey());
  const pending = client.post({ model: 'test-delay-60000', messages: userMessage(), wait: true });
  await until(() => gateway.waiters!.size === 1, 'the request to wait', 30_000);
  await gateway.stop();
  const answer = await pending;
  t.equal(answer.status, 202, 'answered with its acknowledgement');
  t.equal(answer.headers.get('connection'), 'close', 'with Connection: close');
});

t.test('an answer written but still being sent as the server closes is sent in full before its connection ends', async (t) => {
  // An answer larger than the sockets' buffers, to a client that does not read it yet.
  const body = Buffer.alloc(16 * 1024 * 1024, 'x');
  const server = await listen((_request, response) => {
    response.writeHead(200, { 'content-type': 'text/plain' });
    response.end(body);
  }, 0, '127.0.0.1');
  const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  t.teardown(() => agent.destroy());
  const { port } = server.address() as { port: number };
  const response = await new Promise<http.IncomingMessage>((resolve) => http.get(`http://127.0.0.1:${port}/`, { agent }, resolve));
  response.pause();

  const closed = closeServer(server).then(() => Date.now());
  await sleep(200);
  let received = 0;
  response.on('data', (chunk: Buffer) => (received += chunk.length));
  const done = new Promise<string>((resolve) => {
    response.once('end', () => resolve('end'));
    response.once('aborted', () => resolve('aborted'));
  });
  response.resume();
  t.equal(await done, 'end', 'the answer ended');
  t.equal(received, body.length, `the client received all of it (${received} of ${body.length} bytes)`);
  t.ok(await Promise.race([closed, sleep(5_000).then(() => undefined)]), 'and the server closed');
});

t.test('a client that sent part of a request and then nothing does not hold a closing server for good', async (t) => {
  const server = await listen((request, response) => {
    // The body read in full before the answer, as the API's routes read it.
    request.resume();
    request.once('end', () => response.end('ok'));
  }, 0, '127.0.0.1');
  const { port } = server.address() as { port: number };
  const connect = (text: string) =>
    new Promise<net.Socket>((resolve) => {
      const socket = net.connect(port, '127.0.0.1', () => socket.write(text, () => resolve(socket)));
      socket.on('error', () => {});
      t.teardown(() => socket.destroy());
    });
  const ended = (socket: net.Socket) => new Promise<void>((resolve) => socket.once('close', () => resolve()));
  // Part of a head; and a whole head, whose body never comes.
  const head = await connect('POST / HTTP/1.1\r\nHost: x\r\n');
  const body = await connect('POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789');
  await sleep(200);

  const closed = closeServer(server).then(() => 'closed');
  t.equal(await Promise.race([ended(head), sleep(10_000).then(() => 'still open')]), undefined, 'the connection with part of a head is closed');
  // Node ends a request whose whole is not in within requestTimeout (30 s) while it serves, and
  // a closing server no longer does.
  t.equal(await Promise.race([closed, sleep(45_000).then(() => 'still closing')]), 'closed', 'and the server closes, the request without its body given up in time');
  t.equal(await Promise.race([ended(body), sleep(1_000).then(() => 'still open')]), undefined, 'its connection closed');
});
