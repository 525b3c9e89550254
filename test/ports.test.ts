// freePort (scripts/ports.ts), which the suite's and the benchmark's servers take their ports
// from: the kernel may give back a port it has just given, so the helper remembers its own.
import t from 'tap';
import { freePort } from './helpers/ports.ts';

t.test('freePort never hands out one port twice in a process: 1,000 calls, 1,000 ports', async (t) => {
  const ports: number[] = [];
  for (let i = 0; i < 1_000; i++) ports.push(await freePort());
  t.equal(new Set(ports).size, ports.length);
});
