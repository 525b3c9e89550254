// Rotating SECRET_ENCRYPTION_KEY: with SECRET_ENCRYPTION_KEYS=<new>,<old> secrets stored under
// the old key still verify requests and sign webhooks; `gateway keys reencrypt` puts every
// stored secret under the new key (twice, or beside a running gateway, without harm), after
// which the new key alone does; and an API process whose keys decrypt no stored secret refuses
// to start, saying so, rather than answer every signed request with a 500.
import { randomBytes } from 'node:crypto';
import t from 'tap';
import { ConfigError, loadConfig } from '../../src/config.ts';
import { createLogger } from '../../src/logger.ts';
import { startGateway } from '../../src/main.ts';
import { reencryptSecrets } from '../../src/keys/reencryption.ts';
import { createKey, type CreatedKey } from '../../src/keys/service.ts';
import { decryptWith } from '../../src/keys/secrets.ts';
import { addEndpoint, rotateSecret } from '../../src/webhooks/endpoints.ts';
import { runCli } from '../helpers/cli.ts';
import { createTestDatabase } from '../helpers/database.ts';
import { startTestGateway, TEST_SETTINGS } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { freePort } from '../helpers/ports.ts';
import { serveSettings, spawnServe } from '../helpers/serve.ts';
import { until } from '../helpers/wait.ts';
import { startReceiver } from '../webhooks/support.ts';

const newKey = () => randomBytes(32);
/** The settings of a process given these keys, in this order (the first encrypts). */
const withKeys = (...keys: Buffer[]) => ({ SECRET_ENCRYPTION_KEY: '', SECRET_ENCRYPTION_KEYS: keys.map((key) => key.toString('base64')).join(',') });

/** `gateway keys reencrypt --json` with these keys, in this order. */
const reencryptCommand = (databaseUrl: string, keys: Buffer[]) =>
  runCli(['keys', 'reencrypt', '--json'], { DATABASE_URL: databaseUrl, ...withKeys(...keys) });

t.test('SECRET_ENCRYPTION_KEYS: the first key encrypts, every one decrypts; never beside SECRET_ENCRYPTION_KEY', async (t) => {
  const [first, second] = [newKey(), newKey()];
  const config = loadConfig({ SECRET_ENCRYPTION_KEYS: `${first.toString('hex')}, ${second.toString('base64')}` });
  t.same(config.secretEncryptionKeys, [first, second], 'hex or base64, in order');
  t.same(config.secretEncryptionKeys[0], first, 'the first is the one that encrypts');
  t.same(loadConfig({ SECRET_ENCRYPTION_KEY: first.toString('base64') }).secretEncryptionKeys, [first], 'SECRET_ENCRYPTION_KEY: the one key');
  t.same(loadConfig({}).secretEncryptionKeys, []);
  t.throws(
    () => loadConfig({ SECRET_ENCRYPTION_KEY: first.toString('base64'), SECRET_ENCRYPTION_KEYS: second.toString('base64') }),
    { name: 'ConfigError', message: /SECRET_ENCRYPTION_KEY and SECRET_ENCRYPTION_KEYS are both set/ },
  );
  t.throws(() => loadConfig({ SECRET_ENCRYPTION_KEYS: `${first.toString('base64')},abc` }), {
    message: /SECRET_ENCRYPTION_KEYS \(key 2\) must be 32 bytes/,
  });
  t.throws(() => loadConfig({ SECRET_ENCRYPTION_KEYS: `${first.toString('base64')},` }), { message: /key 2/ }, 'an empty item');
});

t.test('a key stored under the old key verifies with new,old; after keys reencrypt, with the new key alone', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  const [oldKey, currentKey] = [newKey(), newKey()];

  // Before the rotation: a key, and a webhook endpoint with a rotated secret, under the old key.
  const before = await startTestGateway(t, { role: 'api', databaseUrl, env: withKeys(oldKey) });
  const key = await before.createKey();
  const settings = { encryptionKey: oldKey, allowPrivate: true };
  const receiver = await startReceiver(t);
  const endpoint = await addEndpoint(before.db, settings, { project: 'test-project', url: receiver.url });
  const rotated = (await rotateSecret(before.db, oldKey, endpoint.id))!;
  receiver.secrets = [rotated.secret, endpoint.secret];
  await before.stop();

  // During it: every process has new,old. The old key's secrets still verify and sign.
  const during = await startTestGateway(t, { databaseUrl, env: { ...withKeys(currentKey, oldKey), WEBHOOK_ALLOW_PRIVATE: 'true' } });
  const signed = await clientFor(during.url, key).post({ model: 'test-echo', messages: userMessage(), wait: true });
  t.equal(signed.status, 200, 'a request signed with a secret stored under the old key verifies');
  await until(() => receiver.deliveries.length === 1, 'the webhook');
  t.same(receiver.deliveries[0]!.verifiedWith, [0, 1], 'its webhook is signed with both secrets, stored under the old key');
  const newer = await during.createKey();
  const newerRow = await keyRow(during, newer);
  t.ok(decryptWith(newerRow.signing_secret_ciphertext, newer.id, currentKey), 'a key created now is stored under the new key');

  const first = await reencryptCommand(databaseUrl, [currentKey, oldKey]);
  t.equal(first.code, 0, first.stderr);
  t.same(JSON.parse(first.stdout), {
    signing_secrets: { reencrypted: 1, current: 1 },
    webhook_endpoints: { reencrypted: 1, current: 0 },
    undecryptable: [],
  });
  const again = await reencryptCommand(databaseUrl, [currentKey, oldKey]);
  t.equal(again.code, 0, again.stderr);
  t.same(JSON.parse(again.stdout).signing_secrets, { reencrypted: 0, current: 2 }, 'run again: nothing left to do');
  t.same(JSON.parse(again.stdout).webhook_endpoints, { reencrypted: 0, current: 1 });
  t.notOk(first.stdout.includes(key.signing_secret) || first.stderr.includes(key.signing_secret), 'no secret printed');

  const row = await keyRow(during, key);
  t.equal(decryptWith(row.signing_secret_ciphertext, key.id, currentKey), key.signing_secret, 'the secret is now under the new key');
  t.equal(decryptWith(row.signing_secret_ciphertext, key.id, oldKey), undefined, 'and no longer under the old one');
  const { rows: endpoints } = await during.pool.query('select secret_ciphertext, previous_secret_ciphertext from gateway.webhook_endpoints');
  t.equal(decryptWith(endpoints[0].secret_ciphertext, endpoint.id, currentKey), rotated.secret, 'the endpoint\'s secret too');
  t.equal(decryptWith(endpoints[0].previous_secret_ciphertext, endpoint.id, currentKey), endpoint.secret, 'and its previous one');
  await during.stop();

  // After it: the new key alone.
  const after = await startTestGateway(t, { databaseUrl, env: { ...withKeys(currentKey), WEBHOOK_ALLOW_PRIVATE: 'true' } });
  const alone = await clientFor(after.url, key).post({ model: 'test-echo', messages: userMessage(), wait: true });
  t.equal(alone.status, 200, 'the key verifies with the new key alone');
  await until(() => receiver.deliveries.length === 2, 'the second webhook');
  t.same(receiver.deliveries[1]!.verifiedWith, [0, 1], 'and its webhooks are signed');
});

t.test('keys reencrypt beside a running gateway, twice at once, in small batches: every request verifies throughout', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  const [oldKey, currentKey] = [newKey(), newKey()];
  const setup = await startTestGateway(t, { role: 'api', databaseUrl, env: withKeys(oldKey) });
  const keys: CreatedKey[] = [];
  for (let i = 0; i < 30; i++) keys.push(await setup.createKey({ project: `p${i % 3}` }));
  await setup.stop();

  const gateway = await startTestGateway(t, { role: 'api', databaseUrl, env: withKeys(currentKey, oldKey) });
  let running = true;
  const statuses: number[] = [];
  const traffic = (async () => {
    for (let round = 0; running || round < 2; round++) {
      const answers = await Promise.all(keys.map((key) => clientFor(gateway.url, key).get('req_00000000000000000000')));
      statuses.push(...answers.map((answer) => answer.status));
    }
  })();
  const [one, two] = await Promise.all([
    reencryptSecrets(gateway.db, [currentKey, oldKey], { batchSize: 7 }),
    reencryptSecrets(gateway.db, [currentKey, oldKey], { batchSize: 4 }),
  ]);
  running = false;
  await traffic;
  t.equal(one.signingSecrets.reencrypted + two.signingSecrets.reencrypted, 30, 'each secret re-encrypted once, by one run or the other');
  t.same([...one.undecryptable, ...two.undecryptable], []);
  t.same(new Set(statuses), new Set([404]), `${statuses.length} signed lookups, all verified (404: no such request), none a 500`);
  const { rows } = await gateway.pool.query('select id, signing_secret_ciphertext from gateway.api_keys');
  t.ok(
    rows.every((row) => decryptWith(row.signing_secret_ciphertext, row.id, currentKey) === keys.find((key) => key.id === row.id)!.signing_secret),
    'every secret is under the new key, and is the secret it was',
  );
});

t.test('keys reencrypt names what none of its keys decrypts, changes nothing of it, and does the rest', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  const [lostKey, oldKey, currentKey] = [newKey(), newKey(), newKey()];
  const gateway = await startTestGateway(t, { role: 'api', databaseUrl, env: withKeys(oldKey) });
  const lost = await createKey(gateway.db, lostKey, { project: 'p', mode: 'test' });
  const kept = await gateway.createKey();
  const lostBefore = (await keyRow(gateway, lost)).signing_secret_ciphertext;

  const result = await reencryptCommand(databaseUrl, [currentKey, oldKey]);
  t.equal(result.code, 1);
  t.match(result.stderr, new RegExp(`None of the 2 keys decrypts the secrets of: ${lost.id}\\.`));
  t.notOk(result.stderr.includes(lost.signing_secret), 'no secret printed');
  t.same((await keyRow(gateway, lost)).signing_secret_ciphertext, lostBefore, 'left as it was');
  t.ok(decryptWith((await keyRow(gateway, kept)).signing_secret_ciphertext, kept.id, currentKey), 'the other one re-encrypted');
});

t.test('an API process whose keys decrypt no stored signing secret refuses to start, saying so', async (t) => {
  const databaseUrl = await createTestDatabase(t);
  const setup = await startTestGateway(t, { role: 'api', databaseUrl });
  const key = await setup.createKey();
  await setup.stop();
  const wrongKey = newKey();
  const message = 'SECRET_ENCRYPTION_KEY(S) cannot decrypt the stored signing secrets: ';

  // In-process (as main.ts wires it), for both roles that serve the API.
  for (const role of ['api', 'all'] as const) {
    const config = loadConfig({ ...TEST_SETTINGS, DATABASE_URL: databaseUrl, SECRET_ENCRYPTION_KEY: wrongKey.toString('base64') });
    const starting = startGateway({ config, logger: createLogger({ logLevel: 'silent' }), role, databaseUrl });
    await t.rejects(starting, new ConfigError(`${message}the signing secret of key ${key.id} was stored with a key other than the one given. Set the key they were stored with; to rotate keys, SECRET_ENCRYPTION_KEYS=<new key>,<old key>, then \`gateway keys reencrypt\`.`), `--role ${role}`);
  }
  const worker = await startTestGateway(t, { role: 'worker', databaseUrl, env: { SECRET_ENCRYPTION_KEY: wrongKey.toString('base64') } });
  t.equal((await send(worker.url, { path: '/healthz' })).status, 200, 'a worker starts and serves /healthz (it signs webhooks, not requests)');
  await worker.stop();

  // As a process: gateway serve, alone and as a cluster's primary, exits 1 with the message.
  for (const processes of ['1', '2']) {
    const settings = serveSettings(setup, await freePort(), { SECRET_ENCRYPTION_KEY: wrongKey.toString('base64'), API_PROCESSES: processes });
    const serve = spawnServe(t, settings, ['--role', 'api']);
    // (A cluster whose primary did not check would replace its failing API processes for ever.)
    const exit = await Promise.race([serve.exited().then((exited) => exited.code), new Promise((resolve) => setTimeout(() => resolve('still running'), 20_000).unref())]);
    t.equal(exit, 1, `API_PROCESSES=${processes}: exits 1`);
    t.match(serve.output(), message, `API_PROCESSES=${processes}: says why`);
    for (const secret of [wrongKey.toString('base64'), key.signing_secret]) t.notOk(serve.output().includes(secret), 'no key or secret in it');
  }
});

async function keyRow(gateway: { pool: import('pg').Pool }, key: { id: string }) {
  const { rows } = await gateway.pool.query('select signing_secret_ciphertext from gateway.api_keys where id = $1', [key.id]);
  return rows[0] as { signing_secret_ciphertext: Buffer };
}
