// Loaded with --import into a process a test starts (NODE_OPTIONS), so that its clock runs
// TEST_CLOCK_OFFSET_MS ahead of the machine's (behind when negative): an API host whose clock
// has drifted from the database's.
const offset = Number(process.env.TEST_CLOCK_OFFSET_MS ?? 0);
const machine = Date.now;
Date.now = () => machine() + offset;
