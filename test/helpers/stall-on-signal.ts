// Loaded with --import into a process a test starts (NODE_OPTIONS): on SIGUSR2 the process
// blocks its event loop for TEST_STALL_MS (2 s unless set), as a long GC pause or a busy
// computation would, then says so on stderr ("stalled the event loop for <ms> ms").
const stallMs = Number(process.env.TEST_STALL_MS ?? 2_000);
process.on('SIGUSR2', () => {
  const from = Date.now();
  while (Date.now() - from < stallMs);
  process.stderr.write(`stalled the event loop for ${Date.now() - from} ms\n`);
});
