// Intake limits (docs/lanes.md, "Intake limits"): RATE_LIMIT_RPS per key with its burst, held
// across API processes through gateway.intake_counters; lookups in a bucket of their own;
// MAX_UNFINISHED_PER_PROJECT per project and mode; and decisions that go on when the database
// cannot be reached.
import { createHash, randomBytes } from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';
import type pg from 'pg';
import t, { type Test } from 'tap';
import { createDb, createPool, type Db } from '../../src/db/pool.ts';
import { ApiError } from '../../src/errors.ts';
import { newRequestId, randomBase62, type KeyMode } from '../../src/ids.ts';
import type { Auth } from '../../src/keys/auth.ts';
import { createLogger } from '../../src/logger.ts';
import { IntakeLimits, intakeLimitsFor, type IntakeConfig, type IntakeLimit } from '../../src/requests/intake.ts';
import { createTestDatabase } from '../helpers/database.ts';
import { freePort } from '../helpers/ports.ts';
import { until } from '../helpers/wait.ts';

const silent = createLogger({ logLevel: 'silent' });

const limitsOf = (overrides: Partial<IntakeConfig>): IntakeConfig => ({
  rateLimitRps: undefined,
  lookupRateLimitRps: undefined,
  rateLimitBytesPerSecond: undefined,
  maxUnfinishedPerProject: undefined,
  maxBodyBytes: 4 * 1024 * 1024,
  ...overrides,
});

/** The size of a small submission's body, counted by the byte rate when one is set. */
const SMALL_BODY = 200;

/** A pool and kysely instance on `url`, as one API process has them. */
function connect(t: Test, url: string): { pool: pg.Pool; db: Db } {
  const pool = createPool(url, { max: 4, applicationName: 'intake-test', logger: silent });
  t.teardown(() => pool.end());
  return { pool, db: createDb(pool) };
}

async function setup(t: Test) {
  const url = await createTestDatabase(t);
  return { url, ...connect(t, url) };
}

/** A key of `project` (created if need be), as authentication would give it. */
async function plantKey(pool: pg.Pool, project: string, mode: KeyMode): Promise<Auth> {
  const { rows } = await pool.query<{ id: string }>(
    `insert into gateway.projects (name) values ($1)
     on conflict (name) do update set name = excluded.name returning id`,
    [project],
  );
  const keyId = `key_${randomBase62(24)}`;
  const ciphertext = Buffer.from('not a real ciphertext');
  await pool.query(
    `insert into gateway.api_keys (id, project_id, mode, key_sha256, key_hint, signing_secret_ciphertext)
     values ($1, $2, $3, $4, 'hint', $5)`,
    [keyId, rows[0]!.id, mode, randomBytes(32), ciphertext],
  );
  return { keyId, projectId: rows[0]!.id, mode, signingSecretCiphertext: ciphertext, requestDeadlineMs: undefined };
}

/** Stores `count` queued requests of the key's project and mode; returns their ids. */
/** Stores a queued request for each id of `ids`, as the API's insert would. */
async function plantRequests(pool: pg.Pool, auth: Auth, ids: readonly string[]): Promise<string[]> {
  for (const [i, id] of ids.entries()) {
    const body = JSON.stringify({ model: 'test-model', messages: [{ role: 'user', content: `planted ${i}` }] });
    await pool.query(
      `insert into gateway.requests (id, project_id, mode, api_key_id, status, model, body, body_sha256)
       values ($1, $2, $3, $4, 'queued', 'test-model', $5::json, $6)`,
      [id, auth.projectId, auth.mode, auth.keyId, body, createHash('sha256').update(body).digest()],
    );
  }
  return [...ids];
}

/** Stores `count` queued requests of the key's project and mode, admitted by no process here. */
function plantUnfinished(pool: pg.Pool, auth: Auth, count: number): Promise<string[]> {
  return plantRequests(pool, auth, Array.from({ length: count }, () => newRequestId()));
}

async function finish(pool: pg.Pool, ids: string[]): Promise<void> {
  await pool.query(
    `update gateway.requests set status = 'completed', result = '{"object":"chat.completion","choices":[]}'::json,
       finished_at = now(), updated_at = now()
     where id = any($1)`,
    [ids],
  );
}

/** The refusal `admit` throws, or undefined when it admits. */
function refusalOf(admit: () => void): ApiError | undefined {
  try {
    admit();
    return undefined;
  } catch (error) {
    if (error instanceof ApiError) return error;
    throw error;
  }
}

function isRateLimitRefusal(error: ApiError | undefined): boolean {
  return (
    error !== undefined &&
    error.status === 429 &&
    error.type === 'rate_limit_error' &&
    error.code === 'rate_limit_exceeded' &&
    Number.isInteger(error.retryAfter) &&
    error.retryAfter! >= 1
  );
}

function started(t: Test, limits: IntakeLimits): IntakeLimits {
  limits.start();
  t.teardown(() => limits.stop());
  return limits;
}

t.test('with no limit set, intakeLimitsFor gives nothing to check', async (t) => {
  const { db } = await setup(t);
  t.equal(intakeLimitsFor(db, limitsOf({})), undefined);
  t.type(intakeLimitsFor(db, limitsOf({ maxUnfinishedPerProject: 10 })), IntakeLimits);
  t.type(intakeLimitsFor(db, limitsOf({ rateLimitRps: 10, lookupRateLimitRps: 100 })), IntakeLimits);
});

t.test('right after start, a key gets a burst of twice its rate at once, then a 429 with retry-after', async (t) => {
  const { pool, db } = await setup(t);
  const auth = await plantKey(pool, 'bursting', 'test');
  const refused: [KeyMode, IntakeLimit][] = [];
  const limits = started(
    t,
    new IntakeLimits(db, limitsOf({ rateLimitRps: 10 }), { onRefused: (mode, limit) => refused.push([mode, limit]) }),
  );

  const burst = Array.from({ length: 20 }, () => refusalOf(() => limits.admitSubmission(auth, SMALL_BODY, newRequestId())));
  t.same(burst.filter(Boolean), [], 'the first 20 are admitted');
  const refusal = refusalOf(() => limits.admitSubmission(auth, SMALL_BODY, newRequestId()));
  t.ok(isRateLimitRefusal(refusal), 'the 21st is refused with 429 rate_limit_exceeded');
  t.equal(refusal?.retryAfter, 1, 'a token comes back within a second');
  t.match(refusal?.message, /rate limit of 10 requests per second; retry after 1 s/);
  t.same(refused, [['test', 'rate']], 'the refusal is counted');
});

t.test('lookups have a bucket of their own: a key out of submissions can still look up', async (t) => {
  const { pool, db } = await setup(t);
  const auth = await plantKey(pool, 'looking', 'live');
  const refused: IntakeLimit[] = [];
  const limits = started(
    t,
    new IntakeLimits(db, limitsOf({ rateLimitRps: 10, lookupRateLimitRps: 100 }), {
      onRefused: (_mode, limit) => refused.push(limit),
    }),
  );

  for (let i = 0; i < 20; i++) limits.admitSubmission(auth, SMALL_BODY, newRequestId());
  t.ok(isRateLimitRefusal(refusalOf(() => limits.admitSubmission(auth, SMALL_BODY, newRequestId()))), 'submissions are exhausted');
  const lookups = Array.from({ length: 200 }, () => refusalOf(() => limits.admitLookup(auth)));
  t.same(lookups.filter(Boolean), [], 'all 200 lookups of the lookup burst are admitted');
  const refusal = refusalOf(() => limits.admitLookup(auth));
  t.ok(isRateLimitRefusal(refusal), 'the lookup burst has its own end');
  t.match(refusal?.message, /lookup rate limit of 100 lookups per second/);
  t.same(refused, ['rate', 'lookup_rate']);
});

t.test('RATE_LIMIT_BYTES_PER_SECOND: a burst of twice the byte rate, then 429 until it refills; a check alone counts nothing', async (t) => {
  const { pool, db } = await setup(t);
  const auth = await plantKey(pool, 'large-bodies', 'live');
  const refused: IntakeLimit[] = [];
  const limits = started(
    t,
    new IntakeLimits(db, limitsOf({ rateLimitBytesPerSecond: 10_000, maxBodyBytes: 4_096 }), {
      onRefused: (_mode, limit) => refused.push(limit),
    }),
  );

  for (let i = 0; i < 5; i++) t.notOk(refusalOf(() => limits.checkSubmission(auth, 15_000)), `check ${i + 1} of 15,000 bytes passes`);
  t.notOk(refusalOf(() => limits.admitSubmission(auth, 15_000, newRequestId())), 'the checks took nothing: 15,000 of the 20,000 are admitted');
  t.ok(isRateLimitRefusal(refusalOf(() => limits.checkSubmission(auth, 15_000))), 'a check now refuses the next 15,000');
  const refusal = refusalOf(() => limits.admitSubmission(auth, 15_000, newRequestId()));
  t.ok(isRateLimitRefusal(refusal), 'and so does admitting them');
  t.equal(refusal?.retryAfter, 1, 'the 10,000 missing come back within a second');
  t.match(refusal?.message, /rate limit of 10000 body bytes per second; retry after 1 s/);
  t.notOk(refusalOf(() => limits.admitSubmission(auth, 5_000, newRequestId())), 'a smaller body that fits what is left is admitted');
  t.ok(isRateLimitRefusal(refusalOf(() => limits.admitSubmission(auth, 100, newRequestId()))), 'then nothing is left');
  t.same(refused, ['bytes_rate', 'bytes_rate', 'bytes_rate'], 'each refusal is counted as the byte rate\'s');

  const large = await plantKey(pool, 'largest-bodies', 'live');
  const slow = started(t, new IntakeLimits(db, limitsOf({ rateLimitBytesPerSecond: 1_024, maxBodyBytes: 1_048_576 })));
  t.notOk(refusalOf(() => slow.admitSubmission(large, 1_048_576, newRequestId())), 'a byte rate below MAX_BODY_BYTES still lets one largest body through');
  t.ok(isRateLimitRefusal(refusalOf(() => slow.admitSubmission(large, 1_048_576, newRequestId()))), 'but not two');

  await limits.sync();
  const { rows } = await pool.query(
    `select kind, admitted from gateway.intake_counters where api_key_id = $1`,
    [auth.keyId],
  );
  t.same(
    rows.map((row) => [row.kind, Number(row.admitted)]),
    [['bytes', 20_000]],
    'the bytes admitted are counted in gateway.intake_counters for the other processes',
  );
});

t.test('what another process admitted is taken from this one\'s bucket at its next sync', async (t) => {
  const { pool, db } = await setup(t);
  const auth = await plantKey(pool, 'shared', 'test');
  const config = limitsOf({ rateLimitRps: 10 });
  // Not started: every sync below is explicit.
  const first = new IntakeLimits(db, config);
  const second = new IntakeLimits(db, config);
  t.teardown(() => Promise.all([first.stop(), second.stop()]));

  first.admitSubmission(auth, SMALL_BODY, newRequestId());
  await first.sync(); // reports 1; the second has admitted nothing yet
  for (let i = 0; i < 20; i++) second.admitSubmission(auth, SMALL_BODY, newRequestId());
  await second.sync(); // reports 20; takes the first's 1 from its bucket
  t.ok(isRateLimitRefusal(refusalOf(() => second.admitSubmission(auth, SMALL_BODY, newRequestId()))), 'the second has spent the burst');
  t.notOk(refusalOf(() => first.admitSubmission(auth, SMALL_BODY, newRequestId())), 'until it syncs, the first knows nothing of it');
  await first.sync();
  const refusal = refusalOf(() => first.admitSubmission(auth, SMALL_BODY, newRequestId()));
  t.ok(isRateLimitRefusal(refusal), 'after its sync, the first refuses too');

  const { rows } = await pool.query(
    'select process_id, admitted from gateway.intake_counters where api_key_id = $1 order by admitted',
    [auth.keyId],
  );
  t.same(
    rows.map((row) => [row.process_id, Number(row.admitted)]),
    [
      [first.processId, 2],
      [second.processId, 20],
    ],
    'each process has its count in gateway.intake_counters',
  );
});

t.test('two API processes sharing a key at 4x its rate admit, together, what RATE_LIMIT_RPS allows, within 10 %', async (t) => {
  const { url, pool, db } = await setup(t);
  const auth = await plantKey(pool, 'busy', 'live');
  const rate = 100;
  const config = limitsOf({ rateLimitRps: rate });
  // Each process with its own pool, as separate API processes have.
  const processes = [new IntakeLimits(db, config), new IntakeLimits(connect(t, url).db, config)];
  for (const limits of processes) started(t, limits);

  const admittedBy = [0, 0];
  const refusals: (ApiError | undefined)[] = [];
  const offerPerSecond = 4 * rate;
  const start = performance.now();
  let offered = 0;
  let lastOfferAt = 0;
  for (;;) {
    const elapsed = performance.now() - start;
    if (elapsed >= 3_000) break;
    // Offered evenly over time, alternately to each process.
    for (const due = Math.floor((elapsed * offerPerSecond) / 1000) + 1; offered < due; offered++) {
      const which = offered % 2;
      const refusal = refusalOf(() => processes[which]!.admitSubmission(auth, SMALL_BODY, newRequestId()));
      if (refusal) refusals.push(refusal);
      else admittedBy[which]!++;
      lastOfferAt = elapsed;
    }
    await sleep(2);
  }

  const admitted = admittedBy[0]! + admittedBy[1]!;
  const allowed = 2 * rate + (rate * lastOfferAt) / 1000;
  const error = (admitted - allowed) / allowed;
  t.comment(
    `offered ${offered} over ${(lastOfferAt / 1000).toFixed(2)} s; admitted ${admitted} ` +
      `(${admittedBy.join(' + ')}); allowed ${allowed.toFixed(0)}; ${(100 * error).toFixed(1)} %`,
  );
  t.ok(Math.abs(error) <= 0.1, `admitted ${admitted} within 10 % of the ${allowed.toFixed(0)} allowed`);
  t.ok(admittedBy.every((count) => count > rate / 2), 'both processes admitted their share');
  t.equal(refusals.length, offered - admitted);
  t.ok(refusals.every(isRateLimitRefusal), 'every refusal is a 429 rate_limit_exceeded with a retry-after of at least 1 s');

  await Promise.all(processes.map((limits) => limits.sync()));
  const { rows } = await pool.query('select sum(admitted) as admitted from gateway.intake_counters where api_key_id = $1', [
    auth.keyId,
  ]);
  t.equal(Number(rows[0].admitted), admitted, 'the counters add up to what was admitted');
});

/** Two API processes (each with its own pool) with the same limits, not started: every sync is explicit. */
function twoProcesses(t: Test, url: string, db: Db, config: IntakeConfig): [IntakeLimits, IntakeLimits] {
  const processes: [IntakeLimits, IntakeLimits] = [new IntakeLimits(db, config), new IntakeLimits(connect(t, url).db, config)];
  t.teardown(() => Promise.all(processes.map((limits) => limits.stop())));
  return processes;
}

/** Admits submissions of `auth` until `limits` refuses one; returns the ids admitted and the refusal. */
function admitUntilRefused(limits: IntakeLimits, auth: Auth): { ids: string[]; refusal: ApiError } {
  const ids: string[] = [];
  for (;;) {
    const id = newRequestId();
    const refusal = refusalOf(() => limits.admitSubmission(auth, SMALL_BODY, id));
    if (refusal) return { ids, refusal };
    ids.push(id);
  }
}

t.test('a burst that reaches two processes before either syncs is admitted by each, once; the rate takes it back', async (t) => {
  const { url, pool, db } = await setup(t);
  const auth = await plantKey(pool, 'bursty', 'live');
  const [first, second] = twoProcesses(t, url, db, limitsOf({ rateLimitRps: 1 }));

  t.same(
    [admitUntilRefused(first, auth).ids.length, admitUntilRefused(second, auth).ids.length],
    [2, 2],
    'each process admits the burst (two seconds\' worth) on its own, not more: 4 together',
  );
  await first.sync(); // reports its 2; has heard of nothing
  await second.sync(); // reports its 2; the first's are its starting point
  await first.sync(); // takes the second's 2 from its bucket: 2 - 2 - 2
  const refusal = refusalOf(() => first.admitSubmission(auth, SMALL_BODY, newRequestId()));
  t.ok(isRateLimitRefusal(refusal));
  t.ok(refusal!.retryAfter! >= 2, `the first owes the second's burst: retry after ${refusal?.retryAfter} s, not 1`);
});

t.test('a project\'s first submissions reaching two processes at once are admitted up to the unfinished limit by each', async (t) => {
  const { url, pool, db } = await setup(t);
  const auth = await plantKey(pool, 'eager', 'test');
  const [first, second] = twoProcesses(t, url, db, limitsOf({ maxUnfinishedPerProject: 3 }));
  // Each counts the project (nothing unfinished) before its first admission.
  await Promise.all([first.checkSubmission(auth, SMALL_BODY), second.checkSubmission(auth, SMALL_BODY)]);

  const admitted = [admitUntilRefused(first, auth), admitUntilRefused(second, auth)];
  t.same(admitted.map(({ ids }) => ids.length), [3, 3], 'each admits 3 on its own: 6 together');
  t.ok(admitted.every(({ refusal }) => isRateLimitRefusal(refusal) && /MAX_UNFINISHED_PER_PROJECT/.test(refusal.message)));
  const ids = await plantRequests(pool, auth, admitted.flatMap((batch) => batch.ids));
  await Promise.all([first.sync(), second.sync()]);
  await finish(pool, ids.slice(0, 3));
  await Promise.all([first.sync(), second.sync()]);
  for (const limits of [first, second]) {
    t.ok(isRateLimitRefusal(refusalOf(() => limits.admitSubmission(auth, SMALL_BODY, newRequestId()))), 'with 3 of the 6 finished, still at the limit');
  }
  await finish(pool, ids.slice(3, 4));
  await Promise.all([first.sync(), second.sync()]);
  t.notOk(refusalOf(() => first.admitSubmission(auth, SMALL_BODY, newRequestId())), 'with 2 unfinished, admitted again');
});

t.test('MAX_UNFINISHED_PER_PROJECT refuses a project and mode at its limit until requests finish', async (t) => {
  const { pool, db } = await setup(t);
  const key = await plantKey(pool, 'backlogged', 'test');
  const liveKey = await plantKey(pool, 'backlogged', 'live');
  const otherProject = await plantKey(pool, 'quiet', 'test');
  const ids = await plantUnfinished(pool, key, 2);
  await finish(pool, await plantUnfinished(pool, key, 2)); // finished ones do not count
  const refused: IntakeLimit[] = [];
  const syncMs = 50;
  const limits = started(
    t,
    new IntakeLimits(db, limitsOf({ maxUnfinishedPerProject: 3 }), { syncMs, onRefused: (_mode, limit) => refused.push(limit) }),
  );

  // A project this process has not counted yet is admitted until its count arrives.
  const first = newRequestId();
  t.notOk(refusalOf(() => limits.admitSubmission(key, SMALL_BODY, first)));
  await plantRequests(pool, key, [first]);
  await limits.sync();
  const refusal = refusalOf(() => limits.admitSubmission(key, SMALL_BODY, newRequestId()));
  t.ok(isRateLimitRefusal(refusal), 'refused with 429 rate_limit_exceeded once its 3 unfinished requests are counted');
  t.equal(refusal?.retryAfter, 1);
  t.match(refusal?.message, /This project has 3 test requests not yet finished, its limit \(MAX_UNFINISHED_PER_PROJECT\)/);
  t.same(refused, ['unfinished']);
  t.notOk(refusalOf(() => limits.admitSubmission(liveKey, SMALL_BODY, newRequestId())), 'the same project in the other mode is admitted');
  t.notOk(refusalOf(() => limits.admitSubmission(otherProject, SMALL_BODY, newRequestId())), 'another project is admitted');

  await finish(pool, ids);
  await sleep(10 * syncMs); // the periodic sync counts again
  t.notOk(refusalOf(() => limits.admitSubmission(key, SMALL_BODY, newRequestId())), 'admitted again once two have finished');
  t.notOk(refusalOf(() => limits.admitSubmission(key, SMALL_BODY, newRequestId())), 'and a second, counted by this process since');
  t.ok(isRateLimitRefusal(refusalOf(() => limits.admitSubmission(key, SMALL_BODY, newRequestId()))), 'the third would be over the limit');
});

t.test('a request admitted and stored while a count is under way is counted once', async (t) => {
  const { url, pool } = await setup(t);
  const key = await plantKey(pool, 'steady', 'test');
  // The process's pool has one connection, which the test holds while the count waits for it.
  const processPool = createPool(url, { max: 1, applicationName: 'intake-test', logger: silent });
  t.teardown(() => processPool.end());
  const limits = new IntakeLimits(createDb(processPool), limitsOf({ maxUnfinishedPerProject: 3 }));
  const admit = async (stored: boolean): Promise<ApiError | undefined> => {
    const id = newRequestId();
    const refusal = refusalOf(() => limits.admitSubmission(key, SMALL_BODY, id));
    if (!refusal && stored) await plantRequests(pool, key, [id]);
    return refusal;
  };

  t.notOk(await admit(true), 'the first');
  await limits.sync();
  const held = await processPool.connect();
  const counting = limits.sync();
  t.notOk(await admit(true), 'the second, stored while the count waits');
  held.release();
  await counting;
  t.notOk(await admit(false), 'the third: two are unfinished, not three');
  await limits.sync();
  t.ok(isRateLimitRefusal(await admit(false)), 'the fourth is over the limit, the third counted while it is not stored yet');
});

t.test('an admission withdrawn counts no more', async (t) => {
  const { pool, db } = await setup(t);
  const key = await plantKey(pool, 'changeable', 'test');
  const limits = new IntakeLimits(db, limitsOf({ maxUnfinishedPerProject: 1 }));
  const id = newRequestId();
  limits.admitSubmission(key, SMALL_BODY, id);
  await limits.sync();
  t.ok(isRateLimitRefusal(refusalOf(() => limits.admitSubmission(key, SMALL_BODY, newRequestId()))), 'at the limit with one admitted');
  limits.withdraw(key, id);
  t.notOk(refusalOf(() => limits.admitSubmission(key, SMALL_BODY, newRequestId())), 'withdrawn, another is admitted');
});

t.test('stale counters are deleted by a sync, and a process deletes its own when it stops', async (t) => {
  const { pool, db } = await setup(t);
  const auth = await plantKey(pool, 'tidy', 'test');
  await pool.query(
    `insert into gateway.intake_counters (api_key_id, kind, process_id, admitted, updated_at)
     values ($1, 'submit', 'api-gone-1-x', 40, now() - interval '2 minutes'),
            ($1, 'lookup', 'api-alive-2-y', 7, now())`,
    [auth.keyId],
  );
  const limits = new IntakeLimits(db, limitsOf({ rateLimitRps: 10, lookupRateLimitRps: 100 }));
  limits.start();
  for (let i = 0; i < 3; i++) limits.admitSubmission(auth, SMALL_BODY, newRequestId());
  limits.admitLookup(auth);
  await limits.sync();
  const counters = async () =>
    (
      await pool.query('select process_id, kind, admitted from gateway.intake_counters order by process_id, kind')
    ).rows.map((row) => `${row.process_id} ${row.kind} ${row.admitted}`);
  t.same(await counters(), [`api-alive-2-y lookup 7`, `${limits.processId} lookup 1`, `${limits.processId} submit 3`].sort());
  await limits.stop();
  t.same(await counters(), ['api-alive-2-y lookup 7']);
});

t.test('keys and projects not seen for a while are forgotten', async (t) => {
  const { pool, db } = await setup(t);
  const auth = await plantKey(pool, 'fleeting', 'test');
  // 50 syncs of 10 ms: forgotten after half a second of quiet.
  const limits = started(
    t,
    new IntakeLimits(db, limitsOf({ rateLimitRps: 100, lookupRateLimitRps: 1000, maxUnfinishedPerProject: 10 }), { syncMs: 10 }),
  );
  limits.admitSubmission(auth, SMALL_BODY, newRequestId());
  limits.admitLookup(auth);
  t.equal(limits.size, 3, 'two buckets and a project');
  await until(() => limits.size === 0, 'the key and the project are forgotten', 3_000);
});

t.test('a database out of reach does not fail admissions: they are decided locally, and the failure is logged once', async (t) => {
  const port = await freePort();
  const lines: string[] = [];
  const logger = createLogger({ logLevel: 'debug' }, { write: (line: string) => void lines.push(line) });
  const pool = createPool(`postgres://postgres@127.0.0.1:${port}/nowhere`, { max: 2, applicationName: 'intake-test', logger });
  t.teardown(() => pool.end());
  const auth: Auth = { keyId: `key_${randomBase62(24)}`, projectId: '1', mode: 'test', signingSecretCiphertext: Buffer.alloc(1), requestDeadlineMs: undefined };
  const limits = started(
    t,
    new IntakeLimits(createDb(pool), limitsOf({ rateLimitRps: 1, maxUnfinishedPerProject: 100 }), { logger, syncMs: 20 }),
  );

  // A token a second: the failed syncs waited for below take a fraction of that, even on a slow
  // machine, so the bucket has not refilled before the third is asked for.
  const burst = Array.from({ length: 2 }, () => refusalOf(() => limits.admitSubmission(auth, SMALL_BODY, newRequestId())));
  t.same(burst.filter(Boolean), [], 'the burst is admitted');
  await until(() => lines.filter((line) => line.includes('"intake limits still not synchronised"')).length >= 4, 'several failed syncs');
  t.ok(isRateLimitRefusal(refusalOf(() => limits.admitSubmission(auth, SMALL_BODY, newRequestId()))), 'the local bucket still refuses the third');
  const warnings = lines.filter((line) => line.includes('"level":"warn"') && line.includes('could not synchronise the intake limits'));
  t.equal(warnings.length, 2, 'one warning for each statement failing (counters, unfinished), however often it fails');
  await sleep(1_100);
  t.notOk(refusalOf(() => limits.admitSubmission(auth, SMALL_BODY, newRequestId())), 'the bucket refills meanwhile');
  await limits.stop();
});
