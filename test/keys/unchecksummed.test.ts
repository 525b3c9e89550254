// Keys of the form before checksums (40 characters after the prefix, none of them a checksum) are
// read only while an active key of that form may exist (src/keys/unchecksummed.ts): otherwise a
// made-up one is refused from its text alone, as a key that fails its checksum is. A process
// believes that none exists only while it hears every change of a key.
import { setTimeout as sleep } from 'node:timers/promises';
import t from 'tap';
import { randomBase62 } from '../../src/ids.ts';
import { revokeKey } from '../../src/keys/repository.ts';
import { UnchecksummedKeys } from '../../src/keys/unchecksummed.ts';
import type { ListenerEvents } from '../../src/db/listener.ts';
import { createLogger } from '../../src/logger.ts';
import { inBatches } from '../helpers/concurrency.ts';
import { testDatabasePool } from '../helpers/database.ts';
import { startTestGateway, type TestGateway } from '../helpers/gateway.ts';
import { clientFor, send, userMessage } from '../helpers/http.ts';
import { createKnownKey } from '../helpers/keys.ts';
import { until } from '../helpers/wait.ts';

const oldFormKey = () => `svc_test_${randomBase62(40)}`;

/** Waits until the API believes that keys without a checksum may exist, or that none does. */
const untilBelieved = (gateway: TestGateway, mayExist: boolean) =>
  until(() => gateway.unchecksummed!.mayExist() === mayExist, `the API to believe that keys without a checksum ${mayExist ? 'may exist' : 'do not'}`);

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
  t.notOk(gateway.unchecksummed!.mayExist(), 'the API knows from its start that none exists');

  const made = Array.from({ length: 500 }, oldFormKey);
  t.same(new Set(await answersWhileKeysLocked(gateway, made)), new Set(['401 invalid_api_key']), 'each refused while the keys could not be read');
  t.equal(gateway.keys!.misses, 0, 'none was read and found missing');
});

t.test('a key made before checksums works, and keys of its form are read while it is active and not once it is revoked', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  t.notOk(gateway.unchecksummed!.mayExist(), 'none at the start');

  // As a gateway of an earlier version stores it (checksummed false), and announces it.
  const old = await createKnownKey(gateway, oldFormKey());
  await untilBelieved(gateway, true);
  t.equal((await clientFor(gateway.url, old).post({ model: 'm', messages: userMessage() })).status, 202, 'the old key authenticates');
  const answer = await send(gateway.url, { path: '/v1/requests/req_0', key: oldFormKey() });
  t.equal(`${answer.status} ${answer.body.error.code}`, '401 invalid_api_key', 'a made-up key of its form is refused');
  t.equal(gateway.keys!.misses, 1, 'after a read that found it missing');

  // And one as `gateway keys create` makes it, with a checksum, which does not count: revoked,
  // the old key is the last without one.
  await gateway.createKey();
  await revokeKey(gateway.db, old.id);
  await untilBelieved(gateway, false);
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

t.test('"none" holds only while every change is heard: a loss or a creation makes such keys readable at once, until a read after them', async (t) => {
  const { db } = await testDatabasePool(t, 'unchecksummed-test');
  const listener = fakeListener();
  const keys = new UnchecksummedKeys(db, listener, createLogger({ logLevel: 'silent' }));
  t.teardown(() => keys.stop());
  await keys.read();
  t.notOk(keys.mayExist(), 'read with the connection up: none');

  listener.lose();
  t.ok(keys.mayExist(), 'the connection lost: they may exist');
  listener.listening = true;
  t.ok(keys.mayExist(), 'the connection up again but not yet read: they still may');
  listener.restore();
  await until(() => !keys.mayExist(), 'a read after the return');

  listener.announce('created:key_00000000000000000000');
  t.ok(keys.mayExist(), 'a creation announced: they may exist, before any read');
  await until(() => !keys.mayExist(), 'the read the creation asked for');

  // A read under way when the connection is lost decides nothing, even if the connection is
  // up again when it ends (its return not yet told): the read after the return does.
  const reading = keys.read();
  listener.lose();
  listener.listening = true;
  await reading;
  t.ok(keys.mayExist(), 'a read begun before a loss leaves them possible');
  listener.restore();
  await until(() => !keys.mayExist(), 'a read after the return');
});
