// gateway requests show | list, stats, upstreams and usage against a working gateway's database;
// keys reencrypt's output when it fails.
import { randomBytes } from 'node:crypto';
import t from 'tap';
import { createKey } from '../src/keys/service.ts';
import { cliOutput, runCli } from './helpers/cli.ts';
import { testDatabasePool } from './helpers/database.ts';
import { startTestGateway } from './helpers/gateway.ts';
import { clientFor, userMessage } from './helpers/http.ts';
import { isTerminal, waitForRow } from './helpers/rows.ts';

t.test('requests show, requests list and stats', async (t) => {
  const gateway = await startTestGateway(t, { env: { MAX_ATTEMPTS: '3' } });
  const alpha = clientFor(gateway.url, await gateway.createKey({ project: 'alpha' }));
  const beta = clientFor(gateway.url, await gateway.createKey({ project: 'beta', mode: 'live', deadlineMs: 1_500 }));
  const flaky = (await alpha.post({ model: 'test-fail-1', messages: userMessage(), idempotency_key: 'flaky-1' })).body.id;
  const broken = (await alpha.post({ model: 'test-error-400', messages: userMessage() })).body.id;
  // No upstream answers here: retried uncharged, it fails when its key's deadline passes.
  const live = (await beta.post({ model: 'gpt-x', messages: userMessage() })).body.id;
  for (const id of [flaky, broken, live]) await waitForRow(gateway.db, id, isTerminal);

  const env = { DATABASE_URL: gateway.databaseUrl };
  const run = (...args: string[]) => cliOutput(args, env);

  const shown = JSON.parse(await run('requests', 'show', flaky, '--json'));
  t.match(shown.request, { id: flaky, project: 'alpha', mode: 'test', status: 'completed', attempts: 2, idempotency_key: 'flaky-1' });
  t.match(shown.attempts, [
    { attempt_number: 1, upstream: 'simulator', outcome: 'failed', charged: true, error_code: 'upstream_server_error' },
    { attempt_number: 2, upstream: 'simulator', outcome: 'succeeded', charged: null },
  ]);
  const human = await run('requests', 'show', flaky);
  t.match(human, new RegExp(`^Request ${flaky}`));
  t.match(human, /status\s+completed/);
  t.match(human, /^#\s+upstream\s+outcome\s+charged\s+error_code/m);
  t.match(human, /^1\s+simulator\s+failed\s+true\s+upstream_server_error/m, 'each attempt names its upstream, and whether it was charged');

  const all = JSON.parse(await run('requests', 'list', '--json'));
  t.same(all.map((row: { id: string }) => row.id), [live, broken, flaky], 'newest first');
  const failedAlpha = JSON.parse(await run('requests', 'list', '--status', 'failed', '--project', 'alpha', '--json'));
  t.same(failedAlpha.map((row: { id: string }) => row.id), [broken]);
  t.same(JSON.parse(await run('requests', 'list', '--mode', 'live', '--limit', '1', '--json')).length, 1);
  t.match(await run('requests', 'list'), /^id\s+project\s+mode\s+status\s+attempts/);

  const stats = JSON.parse(await run('stats', '--json'));
  t.same(
    stats.requests.map((row: { project: string; mode: string; status: string; requests: number }) => [row.project, row.mode, row.status, row.requests]),
    [
      ['alpha', 'test', 'completed', 1],
      ['alpha', 'test', 'failed', 1],
      ['beta', 'live', 'failed', 1],
    ],
  );
  t.equal(stats.waiting.requests, 0);
  t.ok(stats.errors_last_hour.some((row: { error_code: string }) => row.error_code === 'upstream_bad_request'));
  t.same(
    stats.worker_pools.map((row: { kind: string }) => row.kind),
    ['worker', 'pool'],
    'the running worker process and its graphile-worker pool',
  );
  const table = await run('stats');
  t.match(table, /Requests by project, mode and status/);
  t.match(table, /Workers \(each process, and its graphile-worker pool\)/);

  const unknown = await runCli(['requests', 'show', 'req_00000000000000000000'], env);
  t.equal(unknown.code, 1);
  t.match(unknown.stderr, /No request with id/);
  const badStatus = await runCli(['requests', 'list', '--status', 'done'], env);
  t.equal(badStatus.code, 1);
  t.match(badStatus.stderr, /--status must be/);
});

t.test('upstreams and usage', async (t) => {
  const gateway = await startTestGateway(t, { env: { MAX_IN_FLIGHT: '5' } });
  const alpha = clientFor(gateway.url, await gateway.createKey({ project: 'alpha' }));
  const beta = clientFor(gateway.url, await gateway.createKey({ project: 'beta' }));
  for (const client of [alpha, alpha, beta]) {
    t.equal((await client.post({ model: 'test-echo', messages: userMessage('usage counted'), wait: true })).status, 200);
  }
  const env = { DATABASE_URL: gateway.databaseUrl, UPSTREAM_BASE_URL: 'http://127.0.0.1:9/v1' };
  const run = (...args: string[]) => cliOutput(args, env);

  const upstreams = JSON.parse(await run('upstreams', '--json'));
  t.same(upstreams.upstreams, [
    { name: 'default', base_url: 'http://127.0.0.1:9/v1', models: ['*'], renames: {}, max_concurrent: null, requests_per_minute: null, tokens_per_minute: null },
  ], 'the upstreams as this process reads them');
  t.match(
    upstreams.lanes,
    [{ mode: 'test', upstream: 'simulator', model: '*', waiting: 0, running: 0, paused_until: null, health: 'healthy', deployment: 1 }],
    'and each lane, with its health',
  );
  t.match(await run('upstreams'), /^Upstreams \(a model's deployments, preferred in this order[^\n]*\nname\s+base_url/);
  t.match(await run('upstreams'), /\nLanes\nid\s+mode\s+model\s+deployment\s+upstream\s+health/);

  const usage = JSON.parse(await run('usage', '--json'));
  const today = new Date().toISOString().slice(0, 10);
  t.match(usage, [
    { day: today, project: 'alpha', mode: 'test', upstream: 'simulator', model: 'test-echo', requests: 2 },
    { day: today, project: 'beta', mode: 'test', upstream: 'simulator', model: 'test-echo', requests: 1 },
  ]);
  t.ok(usage[0].total_tokens > 0 && usage[0].total_tokens === 2 * usage[1].total_tokens, 'tokens summed per project');
  t.same(JSON.parse(await run('usage', '--project', 'beta', '--json')).map((row: { project: string }) => row.project), ['beta']);
  t.same(JSON.parse(await run('usage', '--since', '2999-01-01', '--json')), [], '--since a day to come: nothing');
  t.match(await run('usage'), /^day\s+project\s+mode\s+upstream\s+model\s+requests/);
  const badDay = await runCli(['usage', '--since', '2026-02-31'], env);
  t.equal(badDay.code, 1);
  t.match(badDay.stderr, /--since must be a day/);
  // A day JavaScript's calendar has and Postgres's does not: refused here, not by the database.
  const yearZero = await runCli(['usage', '--since', '0000-01-01'], env);
  t.equal(yearZero.code, 1);
  t.equal(yearZero.stderr, '--since must be a day, YYYY-MM-DD, of year 1 or after\n');
  t.same(JSON.parse(await run('usage', '--since', '0001-01-01', '--json')).length, 2, 'year 1 is a day');
});

t.test('--project "" filters on that name, which no project has, rather than listing every project', async (t) => {
  const gateway = await startTestGateway(t);
  const alpha = clientFor(gateway.url, await gateway.createKey({ project: 'alpha' }));
  t.equal((await alpha.post({ model: 'test-echo', messages: userMessage(), wait: true })).status, 200);
  const env = {
    DATABASE_URL: gateway.databaseUrl,
    SECRET_ENCRYPTION_KEY: gateway.config.secretEncryptionKeys[0]!.toString('base64'),
    WEBHOOK_ALLOW_PRIVATE: 'true',
  };
  const run = (...args: string[]) => cliOutput(args, env);
  await run('webhooks', 'add', '--project', 'alpha', '--url', 'http://127.0.0.1:9/hook');
  // (As a script's `--project "$PROJECT"` gives it when PROJECT is unset.)
  for (const command of [['keys', 'list'], ['webhooks', 'list'], ['requests', 'list'], ['usage']]) {
    t.equal(JSON.parse(await run(...command, '--json')).length, 1, `${command.join(' ')}: alpha's`);
    t.same(JSON.parse(await run(...command, '--project', '', '--json')), [], `${command.join(' ')} --project "": none`);
  }
});

t.test('tables and requests show escape what a terminal would act on in what clients chose; --json keeps it raw', async (t) => {
  const gateway = await startTestGateway(t, { role: 'api' });
  const client = clientFor(gateway.url, await gateway.createKey({ project: 'alpha' }));
  // Clears the screen, turns red, forges a row, reverses what follows, and more.
  const model = 'evil\x1b[2J\x1b[31m\r\nreq_forged  alpha  test  completed\u202eesrever\u2066\x9b\x7f\tend';
  const escaped = 'evil\\x1b[2J\\x1b[31m\\x0d\\x0areq_forged  alpha  test  completed\\u202eesrever\\u2066\\x9b\\x7f\\x09end';
  const id = (await client.post({ model, messages: userMessage() })).body.id;
  const env = { DATABASE_URL: gateway.databaseUrl };
  const run = (...args: string[]) => cliOutput(args, env);
  // Anything but printable text and the newlines between lines.
  const unprintable = /[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]/;

  const list = await run('requests', 'list');
  t.notMatch(list, unprintable, 'requests list: nothing a terminal acts on');
  t.equal(list.trimEnd().split('\n').length, 3, 'a header, its rule and one row: no forged row');
  t.ok(list.includes(escaped), 'the model shown with its escapes');
  const show = await run('requests', 'show', id);
  t.notMatch(show, unprintable, 'requests show alike');
  t.ok(show.includes(`model            ${escaped}\n`), 'its model field');
  t.equal(JSON.parse(await run('requests', 'list', '--json'))[0].model, model, '--json: the model as it is');
  t.equal(JSON.parse(await run('requests', 'show', id, '--json')).request.model, model);
});

t.test('keys reencrypt that cannot decrypt some secrets still prints its summary on stdout (--json: the JSON alone), the ids on stderr, and exits 1', async (t) => {
  const { url, db } = await testDatabasePool(t, 'cli-admin-reencrypt');
  const [lostKey, currentKey] = [randomBytes(32), randomBytes(32)];
  const lost = await createKey(db, lostKey, { project: 'p', mode: 'test' });
  await createKey(db, currentKey, { project: 'p', mode: 'test' });
  const env = { DATABASE_URL: url, SECRET_ENCRYPTION_KEY: currentKey.toString('base64') };
  const prose = `None of the 1 keys decrypts the secrets of: ${lost.id}. Add the key they were stored with to SECRET_ENCRYPTION_KEYS and run this again.\n`;

  const json = await runCli(['keys', 'reencrypt', '--json'], env);
  t.equal(json.code, 1);
  t.same(JSON.parse(json.stdout), {
    signing_secrets: { reencrypted: 0, current: 1 },
    webhook_endpoints: { reencrypted: 0, current: 0 },
    undecryptable: [lost.id],
  }, 'stdout is the one JSON value');
  t.equal(json.stderr, prose, 'stderr says which, and what to do');

  const human = await runCli(['keys', 'reencrypt'], env);
  t.equal(human.code, 1);
  t.match(human.stdout, /^Signing secrets: 0 re-encrypted with the first key, 1 already were\.\nWebhook endpoints: /);
  t.equal(human.stderr, prose);
});
