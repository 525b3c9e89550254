// Loaded into a child process started with --expose-gc (`node --import`): on SIGUSR2 it collects
// the garbage and prints the memory still in use (the JavaScript heap, and the buffers outside
// it), for a test to bound what the process holds. readMemoryInUse reads it from the test.
import type { GatewayProcess } from './serve.ts';

const LINE = 'memory-probe: in use=';

if (process.env.GATEWAY_MEMORY_PROBE === '1') {
  process.on('SIGUSR2', () => {
    // Twice: what the first collection frees may hold more that only the second can free.
    globalThis.gc!();
    globalThis.gc!();
    const { heapUsed, arrayBuffers } = process.memoryUsage();
    process.stderr.write(`${LINE}${heapUsed + arrayBuffers}\n`);
  });
}

/** The child's node arguments and settings that load this probe. */
export const MEMORY_PROBE = {
  nodeArgs: ['--expose-gc', '--import', new URL(import.meta.url).pathname],
  env: { GATEWAY_MEMORY_PROBE: '1' },
};

/**
 * Asks the child (started with MEMORY_PROBE) for its memory in use after a full collection, in
 * bytes: its heap's objects, and the buffers (ArrayBuffers) that they hold outside the heap.
 */
export async function readMemoryInUse(child: GatewayProcess, timeoutMs = 30_000): Promise<number> {
  const { output } = child;
  const count = () => output().split(LINE).length - 1;
  const before = count();
  child.signal('SIGUSR2');
  const deadline = Date.now() + timeoutMs;
  while (count() === before) {
    if (Date.now() > deadline) throw new Error(`no memory reading from the child within ${timeoutMs} ms:\n${output().slice(-2_000)}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  return Number(/^\d+/.exec(output().split(LINE).at(-1)!)![0]);
}
