// gateway webhooks add | list | remove | rotate-secret against a database: the secret is shown
// once and kept only encrypted, listings never show it, rotation keeps the old one for 24 hours,
// and mistakes get a message and an exit code.
import { randomBytes } from 'node:crypto';
import t from 'tap';
import { createDb, createPool } from '../../src/db/pool.ts';
import { decryptSecret } from '../../src/keys/secrets.ts';
import { createLogger } from '../../src/logger.ts';
import { runCli } from '../helpers/cli.ts';
import { createTestDatabase } from '../helpers/database.ts';

/** `gateway <args>`, private webhook addresses refused (the test run's own setting left out). */
const gateway = (args: string[], env: Record<string, string | undefined>) => runCli(args, { WEBHOOK_ALLOW_PRIVATE: undefined, ...env });

async function setUp(t: Parameters<typeof createTestDatabase>[0] & { teardown(fn: () => Promise<void>): void }) {
  const databaseUrl = await createTestDatabase(t);
  const encryptionKey = randomBytes(32);
  const pool = createPool(databaseUrl, { max: 2, applicationName: 'webhooks-cli-test', logger: createLogger({ logLevel: 'error' }) });
  t.teardown(() => pool.end());
  return {
    pool,
    db: createDb(pool),
    encryptionKey,
    env: { DATABASE_URL: databaseUrl, SECRET_ENCRYPTION_KEY: encryptionKey.toString('base64') },
  };
}

t.test('webhooks add, list, rotate-secret and remove', async (t) => {
  const { pool, encryptionKey, env } = await setUp(t);

  const added = await gateway(['webhooks', 'add', '--project', 'acme', '--url', 'https://hooks.example.com/gateway', '--json'], env);
  t.equal(added.code, 0, added.stderr);
  const endpoint = JSON.parse(added.stdout);
  t.same(Object.keys(endpoint), ['id', 'project', 'url', 'events', 'secret']);
  t.match(endpoint, { project: 'acme', url: 'https://hooks.example.com/gateway' });
  t.match(endpoint.id, /^whe_[A-Za-z0-9]{24}$/);
  t.same(endpoint.events, ['request.completed', 'request.failed', 'request.cancelled'], 'all three events by default');
  t.match(endpoint.secret, /^whsec_[A-Za-z0-9+/]{43}=$/);
  t.equal(Buffer.from(endpoint.secret.slice('whsec_'.length), 'base64').length, 32, 'the base64 of 32 random bytes');

  const human = await gateway(
    ['webhooks', 'add', '--project', 'acme', '--url', 'https://other.example.com/x', '--events', 'request.cancelled, request.failed'],
    env,
  );
  t.equal(human.code, 0, human.stderr);
  t.match(human.stdout, /Added webhook endpoint whe_[A-Za-z0-9]{24} for project "acme"/);
  t.match(human.stdout, /Secret: {2}whsec_[A-Za-z0-9+/]{43}=/);
  t.match(human.stdout, /Events: {2}request\.failed, request\.cancelled/, 'the events named, in their usual order');
  t.match(human.stdout, /shown this once/);
  await gateway(['webhooks', 'add', '--project', 'zeta', '--url', 'https://zeta.example.com/', '--json'], env);

  const { rows } = await pool.query('select * from gateway.webhook_endpoints where id = $1', [endpoint.id]);
  const stored = JSON.stringify(Object.values(rows[0]).map((value) => (Buffer.isBuffer(value) ? value.toString('latin1') : value)));
  t.notOk(stored.includes(endpoint.secret), 'no plain secret is stored');
  t.notOk(stored.includes(endpoint.secret.slice('whsec_'.length)), 'not even without its prefix');
  t.notOk(stored.includes(Buffer.from(endpoint.secret.slice('whsec_'.length), 'base64').toString('latin1')), 'nor its raw bytes');
  t.equal(decryptSecret(rows[0].secret_ciphertext, endpoint.id, [encryptionKey]), endpoint.secret, 'it is kept encrypted, bound to the endpoint id');
  t.throws(() => decryptSecret(rows[0].secret_ciphertext, 'whe_someotherendpoint00000', [encryptionKey]), 'and cannot be read as another endpoint\'s');

  const listed = await gateway(['webhooks', 'list', '--project', 'acme', '--json'], env);
  t.equal(listed.code, 0, listed.stderr);
  const endpoints = JSON.parse(listed.stdout);
  t.equal(endpoints.length, 2, 'the project\'s endpoints only');
  t.match(endpoints[0], { id: endpoint.id, project: 'acme', url: endpoint.url, events: endpoint.events, status: 'active', disabled_at: null, previous_secret_expires_at: null });
  t.notOk(listed.stdout.includes('whsec_'), 'a listing never shows a secret');
  t.equal(JSON.parse((await gateway(['webhooks', 'list', '--json'], env)).stdout).length, 3, 'every project without --project');
  const table = await gateway(['webhooks', 'list'], env);
  t.match(table.stdout, /^id\s+project\s+url\s+events\s+status/m);
  t.notOk(table.stdout.includes('whsec_'));

  const rotated = await gateway(['webhooks', 'rotate-secret', endpoint.id, '--json'], env);
  t.equal(rotated.code, 0, rotated.stderr);
  const rotation = JSON.parse(rotated.stdout);
  t.same(Object.keys(rotation), ['id', 'secret', 'previous_secret_expires_at']);
  t.match(rotation.secret, /^whsec_[A-Za-z0-9+/]{43}=$/);
  t.not(rotation.secret, endpoint.secret);
  const overlap = Date.parse(rotation.previous_secret_expires_at) - Date.now();
  t.ok(overlap > 23.9 * 3600_000 && overlap <= 24 * 3600_000, 'the old secret keeps signing for 24 hours');
  const { rows: after } = await pool.query('select * from gateway.webhook_endpoints where id = $1', [endpoint.id]);
  t.equal(decryptSecret(after[0].secret_ciphertext, endpoint.id, [encryptionKey]), rotation.secret, 'the new one is current');
  t.equal(decryptSecret(after[0].previous_secret_ciphertext, endpoint.id, [encryptionKey]), endpoint.secret, 'the old one is kept beside it, encrypted');
  const rotatedHuman = await gateway(['webhooks', 'rotate-secret', endpoint.id], env);
  t.match(rotatedHuman.stdout, /previous secret keeps signing deliveries beside this one until \d{4}-\d\d-\d\dT/);
  const relisted = JSON.parse((await gateway(['webhooks', 'list', '--project', 'acme', '--json'], env)).stdout);
  t.ok(relisted[0].previous_secret_expires_at, 'the listing says until when the old secret signs');

  const removed = await gateway(['webhooks', 'remove', endpoint.id, '--json'], env);
  t.equal(removed.code, 0, removed.stderr);
  t.match(JSON.parse(removed.stdout), { id: endpoint.id, project: 'acme', undelivered_messages: 0 });
  t.equal(JSON.parse((await gateway(['webhooks', 'list', '--project', 'acme', '--json'], env)).stdout).length, 1);
  const again = await gateway(['webhooks', 'remove', endpoint.id], env);
  t.equal(again.code, 1);
  t.match(again.stderr, /No webhook endpoint with id/);
  const rotateUnknown = await gateway(['webhooks', 'rotate-secret', 'whe_000000000000000000000000'], env);
  t.equal(rotateUnknown.code, 1);
  t.match(rotateUnknown.stderr, /No webhook endpoint with id/);
});

t.test('webhooks mistakes get a message and a non-zero exit, not a stack trace', async (t) => {
  const { env } = await setUp(t);
  const cases: { args: string[]; env?: Record<string, string | undefined>; code: number; message: RegExp }[] = [
    { args: ['webhooks', 'add', '--project', 'acme'], code: 2, message: /needs --project <name> and --url <url>/ },
    { args: ['webhooks', 'add', '--url', 'https://x.example.com/'], code: 2, message: /needs --project/ },
    { args: ['webhooks', 'add', '--project', 'acme', '--url', 'http://x.example.com/'], code: 1, message: /must be https:\/\/ \(http:\/\/ only with WEBHOOK_ALLOW_PRIVATE=true\)/ },
    { args: ['webhooks', 'add', '--project', 'acme', '--url', 'https://127.0.0.1/'], code: 1, message: /not a public address/ },
    { args: ['webhooks', 'add', '--project', 'acme', '--url', 'https://x.example.com/', '--events', 'request.done'], code: 1, message: /Events are request\.completed, request\.failed, request\.cancelled/ },
    { args: ['webhooks', 'add', '--project', 'acme', '--url', 'https://x.example.com/', '--events', ','], code: 1, message: /at least one event/ },
    { args: ['webhooks', 'add', '--project', 'no spaces', '--url', 'https://x.example.com/'], code: 1, message: /project name/ },
    { args: ['webhooks', 'add', '--project', 'acme', '--url', 'https://x.example.com/'], env: { SECRET_ENCRYPTION_KEY: undefined }, code: 1, message: /SECRET_ENCRYPTION_KEY is not set/ },
    { args: ['webhooks', 'rotate-secret'], code: 2, message: /needs exactly one endpoint id/ },
    { args: ['webhooks', 'remove', 'a', 'b'], code: 2, message: /needs exactly one endpoint id/ },
    { args: ['webhooks', 'remove', 'key_000000000000000000000000'], code: 2, message: /key_000000000000000000000000 is not an endpoint id \(whe_\.\.\.\)/ },
    { args: ['webhooks', 'rotate-secret', 'whe_'], code: 2, message: /whe_ is not an endpoint id/ },
    { args: ['webhooks', 'frobnicate'], code: 2, message: /webhooks takes add, list, remove or rotate-secret/ },
    { args: ['webhooks', 'list', '--colour'], code: 2, message: /Unknown option/ },
  ];
  for (const { args, env: extra, code, message } of cases) {
    const result = await gateway(args, { ...env, ...extra });
    t.equal(result.code, code, `${args.join(' ')}: exit ${code}`);
    t.match(result.stderr, message);
    t.notMatch(result.stderr, /\n\s+at /, 'no stack trace');
  }
  const usage = await gateway(['webhooks'], env);
  t.match(usage.stderr, /webhooks add --project <name> --url <url>/, 'the usage lists the webhooks commands');

  const allowed = await gateway(['webhooks', 'add', '--project', 'acme', '--url', 'http://127.0.0.1:9000/hooks', '--json'], {
    ...env,
    WEBHOOK_ALLOW_PRIVATE: 'true',
  });
  t.equal(allowed.code, 0, 'WEBHOOK_ALLOW_PRIVATE=true accepts http:// and loopback');
});
