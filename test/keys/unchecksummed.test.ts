// Keys of the form before checksums (40 characters after the prefix, none of them a checksum) are
// read only if they may be active (src/keys/unchecksummed.ts): an API process keeps the hashes of
// the active keys of that form, and refuses any other key of that form from its text and hash
// alone, as it refuses a key that fails its checksum. It trusts its list only while it hears every
// change of a key.
import { randomBytes } from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { randomBase62 } from '../../src/ids.ts';
import { revokeKey } from '../../src/keys/repository.ts';
import { hashApiKey } from '../../src/keys/secrets.ts';
import { MAX_KNOWN, UnchecksummedKeys } from '../../src/keys/unchecksummed.ts';
import type { ListenerEvents } from '../../src/db/listener.ts';
import { createLogger } from '../../src/logger.ts';
import { inBatches } from '../helpers/concurrency.ts';
import { testDatabasePool } from '../helpers/database.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { createKnownKey, storeKnownKey } from '../helpers/keys.ts';
import { until } from '../helpers/wait.ts';

const oldFormKey = () => `svc_test_${randomBase62(40)}`;

/** Waits until the API knows of this many active keys without a checksum. */
const untilKnown = (gateway: TestGateway, count: number) =>
  until(() => gateway.unchecksummed!.known === count, `the API to know of ${count} active keys without a checksum`);

/** The answers to made-up keys of the old form, sent while gateway.api_keys is locked against reads. */
async function answersWhileKeysLocked(gateway: TestGateway, keys: string[]): Promise<string[]> {
  const locker = await gateway.pool.connect();
  try {
    await locker.query('begin');
    await locker.query('lock table gateway.api_keys in access exclusive mode');
    // A request that read the table would wait for the lock: each is given 5 s.
    return await inBatches(keys, 50, (key) =>
      Promise.race([
        send(gateway.url, { path: '/v1/requests/req_0', key }).then((answer) => `${answer.status} ${answer.body?.error?.code}`),
        sleep(5_000).then(() => 'no answer within 5 s'),
      ]),
    );
  } finally {
    await locker.query('rollback');
    locker.release();
  }
}

t.test('with no key without a checksum, 500 made-up keys of that form are refused 401 without a read', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  t.equal(gateway.unchecksummed!.known, 0, 'the API knows from its start that none is active');

  const made = Array.from({ length: 500 }, oldFormKey);
  t.same(new Set(await answersWhileKeysLocked(gateway, made)), new Set(['401 invalid_api_key']), 'each refused while the keys could not be read');
  t.equal(gateway.keys!.misses, 0, 'none was read and found missing');
});

t.test('a key made before checksums works; made-up keys of its form are refused without a read, while it is active and once it is revoked', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  t.equal(gateway.unchecksummed!.known, 0, 'none at the start');

  // As a gateway of an earlier version stores it (checksummed false), and announces it.
  const old = await createKnownKey(gateway, oldFormKey());
  await untilKnown(gateway, 1);
  t.equal((await clientFor(gateway.url, old).post({ model: 'm', messages: userMessage() })).status, 202, 'the old key authenticates');
  const whileActive = await answersWhileKeysLocked(gateway, Array.from({ length: 100 }, oldFormKey));
  t.same(new Set(whileActive), new Set(['401 invalid_api_key']), 'made-up keys of its form are refused while the keys could not be read');
  t.equal(gateway.keys!.misses, 0, 'none was read and found missing');

  // And one as `gateway keys create` makes it, with a checksum, which does not count: revoked,
  // the old key was the only one without one.
  await gateway.createKey();
  await revokeKey(gateway.db, old.id);
  await until(() => !gateway.unchecksummed!.mayBeActive(hashApiKey(old.api_key)), 'the API to hear of the revocation');
  t.equal(gateway.unchecksummed!.known, 0, 'none is left');
  const answers = await answersWhileKeysLocked(gateway, [old.api_key, ...Array.from({ length: 20 }, oldFormKey)]);
  t.same(new Set(answers), new Set(['401 invalid_api_key']), 'once it is revoked, keys of its form (itself too) are refused without a read');
});

/** A stand-in for the LISTEN connection: announcements, losses and returns are made by hand. */
function fakeListener() {
  const subscribers: ListenerEvents[] = [];
  const listener = {
    listening: true,
    subscribe: (_channel: string, events: ListenerEvents) => void subscribers.push(events),
    announce: (payload: string) => subscribers.forEach((events) => events.notification(payload)),
    lose: () => {
      listener.listening = false;
      subscribers.forEach((events) => events.lost?.());
    },
    restore: () => {
      listener.listening = true;
      subscribers.forEach((events) => events.restored?.());
    },
  };
  return listener as typeof listener & ConstructorParameters<typeof UnchecksummedKeys>[1];
}

t.test('the list holds only while every change is heard: a loss or any change of a key makes every key of that form possible at once, until a read after them', async (t) => {
  const { db } = await testDatabasePool(t, 'unchecksummed-test');
  const old = await storeKnownKey(db, randomBytes(32), { apiKey: oldFormKey(), project: 'p', mode: 'test' });
  const made = hashApiKey(oldFormKey());
  const listener = fakeListener();
  const keys = new UnchecksummedKeys(db, listener, createLogger({ logLevel: 'silent' }));
  t.teardown(() => keys.stop());
  t.ok(keys.mayBeActive(made), 'before any read, any key of that form may be active');
  await keys.read();
  t.equal(keys.known, 1, 'read with the connection up: one');
  t.ok(keys.mayBeActive(hashApiKey(old.api_key)), 'the stored key may be active');
  t.notOk(keys.mayBeActive(made), 'a made-up one may not');

  listener.lose();
  t.ok(keys.mayBeActive(made), 'the connection lost: any may be');
  listener.listening = true;
  t.ok(keys.mayBeActive(made), 'the connection up again but not yet read: any still may be');
  listener.restore();
  await until(() => !keys.mayBeActive(made), 'a read after the return');

  for (const payload of ['created:key_00000000000000000000', old.id]) {
    listener.announce(payload);
    t.ok(keys.mayBeActive(made), `a change announced (${payload}): any may be, before any read`);
    await until(() => !keys.mayBeActive(made), 'the read the change asked for');
  }

  // A read under way when the connection is lost decides nothing, even if the connection is
  // up again when it ends (its return not yet told): the read after the return does.
  const reading = keys.read();
  listener.lose();
  listener.listening = true;
  await reading;
  t.ok(keys.mayBeActive(made), 'a read begun before a loss leaves any possible');
  listener.restore();
  await until(() => !keys.mayBeActive(made), 'a read after the return');
});

t.test(`with more than ${MAX_KNOWN} active keys without a checksum, the process keeps none of them: every key of that form may be active`, async (t) => {
  const { db, pool } = await testDatabasePool(t, 'unchecksummed-test');
  const stored = await storeKnownKey(db, randomBytes(32), { apiKey: oldFormKey(), project: 'p', mode: 'test' });
  // MAX_KNOWN more, as a gateway of an earlier version stored them (the ciphertexts are never read here).
  await pool.query(
    `insert into gateway.api_keys (id, project_id, mode, key_sha256, key_hint, signing_secret_ciphertext)
     select 'key_many' || lpad(n::text, 16, '0'), project_id, 'test', sha256(convert_to('made ' || n, 'UTF8')), 'abcd', '\\x00'
     from generate_series(1, $1::int) as n, (select project_id from gateway.api_keys where id = $2) as stored`,
    [MAX_KNOWN, stored.id],
  );
  const listener = fakeListener();
  const keys = new UnchecksummedKeys(db, listener, createLogger({ logLevel: 'silent' }));
  t.teardown(() => keys.stop());
  await keys.read();
  t.equal(keys.known, undefined, 'too many to keep');
  t.ok(keys.mayBeActive(hashApiKey(oldFormKey())), 'a made-up key of that form may be active');

  await pool.query(`update gateway.api_keys set revoked_at = now() where id like 'key_many%'`);
  listener.announce(stored.id);
  await until(() => keys.known === 1, 'the read after the revocations');
  t.notOk(keys.mayBeActive(hashApiKey(oldFormKey())), 'with one left, a made-up key of that form may not be active');
});
