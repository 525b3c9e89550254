// The README's client example, run as users run it, against a real gateway.
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import t from 'tap';
import { startTestGateway } from '../helpers/gateway.ts';
import { childEnv } from '../helpers/node-child.ts';

t.test('examples/quickstart.ts runs to the end and prints what the README says', async (t) => {
  const gateway = await startTestGateway(t);
  const key = await gateway.createKey({ mode: 'test' });
  const { stdout } = await promisify(execFile)(
    process.execPath,
    ['--conditions=gateway-source', new URL('../../examples/quickstart.ts', import.meta.url).pathname],
    {
      env: {
        ...childEnv(),
        GATEWAY_API_KEY: key.api_key,
        GATEWAY_SIGNING_SECRET: key.signing_secret,
        GATEWAY_BASE_URL: gateway.url,
      },
    },
  );
  t.match(stdout, /^answered at once: Hello!$/m);
  t.match(stdout, /^queued as req_[A-Za-z0-9]+ \(chat\.completion\.async\)$/m);
  t.match(stdout, /^completed after 1 attempt\(s\): Take your time\.$/m);
  t.match(stdout, /^lookup of an unknown id: 404 not_found_error request_not_found$/m);
});
