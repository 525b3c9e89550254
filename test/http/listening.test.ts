// A client that opens hundreds of connections at once, each sending requests back to back, and
// another client's new connection among them. libuv accepts one connection per listening socket
// in a turn of the event loop, and each turn of the flooded API process serves a request on
// every connection it has accepted: behind a single socket's queue, the other client's
// connection would wait for a turn per connection of the flood, through tens of thousands of the
// flood's answers (seconds, on any machine). The API listens on LISTENING_SOCKETS sockets
// (http/server.ts), and accepts as many connections a turn.
//
// The connections are all made while the API process is stopped (SIGSTOP), so that all of them
// wait to be accepted when it runs again, the other client's last; what is counted is how many
// answers the flood got before the other client's, not a time. And sockets that share a port
// still refuse one in use, as a single socket does.
import net from 'node:net';
import t from 'tap';
import { closeServer, listen, LISTENING_SOCKETS } from '../../src/http/server.ts';
import { apiProcess } from '../helpers/serve.ts';

const FLOOD = 256;
const REQUEST = 'GET /healthz HTTP/1.1\r\nhost: gateway\r\n\r\n';

/** A connection that sends GET /healthz again as soon as each answer has come; counts the answers. */
function connect(port: number, onAnswer: () => void): Promise<net.Socket> {
  return new Promise((resolve, reject) => {
    const socket = net.connect({ port, host: '127.0.0.1' }, () => resolve(socket));
    socket.once('error', reject);
    let received = '';
    socket.setEncoding('latin1');
    socket.on('data', (chunk: string) => {
      received += chunk;
      // Each answer is small and complete once its body (`{"status":"ok"}`-like JSON) has come.
      for (let end = received.indexOf('}'); end !== -1; end = received.indexOf('}')) {
        received = received.slice(end + 1);
        onAnswer();
        if (!socket.destroyed) socket.write(REQUEST);
      }
    });
  });
}

t.test(`a flood of ${FLOOD} new connections does not hold another client's new connection behind it`, async (t) => {
  const api = await apiProcess(t);
  await api.start();
  const port = Number(new URL(api.url!).port);

  api.signal('SIGSTOP');
  t.teardown(() => api.signal('SIGCONT'));
  let floodAnswers = 0;
  const flood = await Promise.all(Array.from({ length: FLOOD }, () => connect(port, () => floodAnswers++)));
  t.teardown(() => flood.forEach((socket) => socket.destroy()));
  let answersBefore: number | undefined;
  const other = await connect(port, () => {
    answersBefore ??= floodAnswers;
    other.destroy();
  });
  for (const socket of [...flood, other]) socket.write(REQUEST);

  api.signal('SIGCONT');
  await new Promise<void>((resolve) => other.once('close', () => resolve()));
  flood.forEach((socket) => socket.destroy());

  // Behind one socket, the other connection is accepted after all of the flood's, a turn each,
  // and each turn answers every connection accepted before it: some FLOOD² / 2 (32,768) answers.
  // Over LISTENING_SOCKETS sockets, the kernel spreads the connections at random: the other one
  // waits for as many turns as its socket has connections before it, about FLOOD /
  // LISTENING_SOCKETS (16) and rarely more than 30, while the turns answer up to 16 more of the
  // flood's connections each: a few thousand answers.
  const bound = FLOOD * 40;
  t.ok(answersBefore !== undefined && answersBefore < bound, `the other client was answered after ${answersBefore} of the flood's answers (fewer than ${bound}; ${LISTENING_SOCKETS} listening sockets)`);
});

t.test('a port in use is refused, whether its holder shares it or not', async (t) => {
  const answer: Parameters<typeof listen>[0] = (_request, response) => response.end();
  const first = await listen(answer, 0, '127.0.0.1');
  t.teardown(() => closeServer(first));
  const { port } = first.address() as net.AddressInfo;
  await t.rejects(listen(answer, port, '127.0.0.1'), { code: 'EADDRINUSE' }, 'a second server on the port of one that shares it');

  const plain = net.createServer();
  await new Promise<void>((resolve) => plain.listen(0, '127.0.0.1', resolve));
  t.teardown(() => new Promise<void>((resolve) => plain.close(() => resolve())));
  await t.rejects(listen(answer, (plain.address() as net.AddressInfo).port, '127.0.0.1'), { code: 'EADDRINUSE' }, 'a server on the port of a plain one');

  // And the first still answers, on whichever socket a connection reaches.
  const statuses = await Promise.all(Array.from({ length: 32 }, () => fetch(`http://127.0.0.1:${port}/`).then((response) => response.status)));
  t.same(new Set(statuses), new Set([200]), 'the first still answers every connection');
});
