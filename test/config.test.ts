// Settings checked across variables: a bad start-up names every variable at fault in one message.
import t from 'tap';
import { loadConfig } from '../src/config.ts';

t.test('every fault across variables is named in one message', async (t) => {
  t.throws(
    () =>
      loadConfig({
        PORT: '9000',
        METRICS_PORT: '9000',
        SHUTDOWN_GRACE_MS: '8000',
        WORKER_DEAD_AFTER_MS: '7000',
        SECRET_ENCRYPTION_KEYS: 'abc,def',
        UPSTREAMS_FILE: '/nonexistent/upstreams.json',
      }),
    {
      name: 'ConfigError',
      message: [
        'Invalid settings:',
        '  METRICS_PORT (9000) must not be PORT: metrics are served apart from the API',
        '  SHUTDOWN_GRACE_MS (8000) must be below WORKER_DEAD_AFTER_MS (7000)',
        '  SECRET_ENCRYPTION_KEYS (key 1) must be 32 bytes, written as 64 hex digits or in base64 (for example the output of `openssl rand -base64 32`)',
        '  SECRET_ENCRYPTION_KEYS (key 2) must be 32 bytes, written as 64 hex digits or in base64 (for example the output of `openssl rand -base64 32`)',
        '  UPSTREAMS_FILE: Invalid upstreams file /nonexistent/upstreams.json: cannot be read (ENOENT)',
      ].join('\n'),
    },
  );
});

t.test('one fault is the message alone', async (t) => {
  t.throws(() => loadConfig({ SHUTDOWN_GRACE_MS: '7000' }), {
    message: 'Invalid settings:\n  SHUTDOWN_GRACE_MS (7000) must be below WORKER_DEAD_AFTER_MS (7000)',
  });
  t.throws(() => loadConfig({ PORT: 'x' }), { message: 'Invalid settings:\n  PORT must be a whole number' });
});
