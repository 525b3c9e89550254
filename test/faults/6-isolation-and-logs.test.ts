// Fault 6: reads across projects and modes, then what the logs of the whole suite hold.
// 100 requests (50 test-mode, 50 live) are read with keys of the other mode and of another
// project: every read is a 404 request_not_found, answered exactly as an unknown id is. Then
// every line logged by every process the suite started (each scenario's gateway processes and
// its own Postgres, kept in the run's log directory) is searched for API keys, signing secrets,
// the upstream key and message contents: none may appear.
import { readFileSync } from 'node:fs';
import path from 'node:path';
import t from 'tap';
import { newRequestId } from '../../src/ids.ts';
import { completionFor, startFakeUpstream } from '../helpers/upstream.ts';
import { call, inBatches, tally, type Call } from './support/client.ts';
import { faultContext } from './support/context.ts';
import { CONTENT_MARKER, logFiles, privateContent, recordedSecrets, removeRunDirectory, runDirectory, UPSTREAM_API_KEY } from './support/run.ts';

t.test('cross-project and cross-mode reads of 100 ids are all 404 request_not_found, indistinguishable from unknown ids', async (t) => {
  const upstream = await startFakeUpstream(t, (received) => ({ status: 200, json: completionFor(received.body) }));
  const faults = await faultContext(t, '6-isolation-and-logs');
  const env = { UPSTREAM_BASE_URL: upstream.baseUrl };
  const api = await faults.start('api', { env });
  const worker = await faults.start('worker', { env });
  const keys = {
    test: await faults.createKey({ project: 'faults-isolation', mode: 'test' }),
    testToo: await faults.createKey({ project: 'faults-isolation', mode: 'test' }),
    live: await faults.createKey({ project: 'faults-isolation', mode: 'live' }),
    otherTest: await faults.createKey({ project: 'faults-isolation-other', mode: 'test' }),
    otherLive: await faults.createKey({ project: 'faults-isolation-other', mode: 'live' }),
  };

  const created = await inBatches(Array.from({ length: 100 }, (_, i) => i), 20, (i) => {
    const owner = i < 50 ? keys.test : keys.live;
    return call(api.url!, {
      path: '/v1/chat/completions',
      key: owner,
      body: { model: i < 50 ? 'test-echo' : 'gpt-isolation', messages: [{ role: 'user', content: privateContent(`scenario 6 request ${i}`) }], idempotency_key: `isolation-${i}` },
    });
  });
  t.same(tally(created.map((answer) => answer.status)), '202: 100', '100 requests stored, 50 in each mode');
  const testIds = created.slice(0, 50).map((answer) => answer.body.id as string);
  const liveIds = created.slice(50).map((answer) => answer.body.id as string);
  t.ok(upstream.calls.length > 0 && upstream.calls.every((received) => received.headers.authorization === `Bearer ${UPSTREAM_API_KEY}`), 'live requests reached the upstream with UPSTREAM_API_KEY');

  const read = (key: (typeof keys)[keyof typeof keys], ids: string[]) =>
    inBatches(ids, 20, (id) => call(api.url!, { path: `/v1/requests/${id}`, key }));
  const owners = [...(await read(keys.test, testIds)), ...(await read(keys.testToo, testIds)), ...(await read(keys.live, liveIds))];
  t.same(tally(owners.map((answer) => answer.status)), '200: 150', 'their own project and mode read them, with any of its keys');

  const unknown = await read(keys.test, [newRequestId()]);
  t.equal(unknown[0]?.status, 404, 'an unknown id is a 404');
  const crossed: { reader: string; answers: Call[] }[] = [
    { reader: 'test ids, read by the same project in live mode', answers: await read(keys.live, testIds) },
    { reader: 'live ids, read by the same project in test mode', answers: await read(keys.test, liveIds) },
    { reader: 'test ids, read by another project in test mode', answers: await read(keys.otherTest, testIds) },
    { reader: 'live ids, read by another project in live mode', answers: await read(keys.otherLive, liveIds) },
    { reader: 'test ids, read by another project in live mode', answers: await read(keys.otherLive, testIds) },
    { reader: 'live ids, read by another project in test mode', answers: await read(keys.otherTest, liveIds) },
  ];
  for (const { reader, answers } of crossed) {
    t.same(
      answers.filter((answer) => answer.status !== 404 || JSON.stringify(answer.body) !== JSON.stringify(unknown[0]?.body)).map((answer) => [answer.status, answer.body]).slice(0, 5),
      [],
      `${reader}: all ${answers.length} are 404 request_not_found, the same answer as for an unknown id`,
    );
  }
  t.same(unknown[0]?.body?.error?.code, 'request_not_found', 'with code request_not_found');
  t.comment(`${crossed.reduce((sum, { answers }) => sum + answers.length, 0)} cross-project and cross-mode reads of 100 ids: ${tally(crossed.flatMap(({ answers }) => answers.map((answer) => `${answer.status} ${answer.body?.error?.code}`)))}`);

  // The processes stop as operators stop them, so their shutdown is logged too.
  const exits = [await api.kill('SIGTERM'), await worker.kill('SIGTERM')];
  t.same(exits.map((exit) => exit?.code), [0, 0], 'SIGTERM stops both processes cleanly');
});

t.test('the logs of every process the fault suite started hold no API key, signing secret, upstream key or message content', async (t) => {
  const files = logFiles();
  const secrets = recordedSecrets();
  // Each value, and for keys and secrets also what follows their prefix, so that a partial
  // leak is found too.
  const needles = [
    ...secrets.flatMap((secret) => {
      const rest = secret.value.replace(/^svc_(live|test|sig)_/, '');
      return [{ kind: secret.kind, value: secret.value }, ...(rest !== secret.value ? [{ kind: `${secret.kind} (without its prefix)`, value: rest }] : [])];
    }),
    { kind: 'upstream_api_key', value: UPSTREAM_API_KEY },
    { kind: 'message content', value: CONTENT_MARKER },
  ];
  const shapes = [
    { kind: 'something shaped like an API key or signing secret', pattern: /svc_(live|test|sig)_[A-Za-z0-9]{8,}/ },
    { kind: 'a bearer credential', pattern: /Bearer [A-Za-z0-9_-]{16,}/ },
  ];

  const leaks: string[] = [];
  const linesByScenario = new Map<string, number>();
  for (const file of files) {
    const name = path.basename(file);
    const lines = readFileSync(file, 'utf8').split('\n');
    const scenario = name.split('.')[0]!;
    linesByScenario.set(scenario, (linesByScenario.get(scenario) ?? 0) + lines.length);
    lines.forEach((line, index) => {
      for (const needle of needles) if (line.includes(needle.value)) leaks.push(`${name}:${index + 1}: ${needle.kind}`);
      for (const shape of shapes) if (shape.pattern.test(line)) leaks.push(`${name}:${index + 1}: ${shape.kind}`);
    });
  }
  const keysRecorded = secrets.filter((secret) => secret.kind === 'api_key').length;
  t.comment(`searched ${files.length} log files (${[...linesByScenario].map(([scenario, lines]) => `${scenario}: ${lines} lines`).join(', ')})`);
  t.comment(`for ${keysRecorded} API keys and as many signing secrets (from ${new Set(secrets.map((secret) => secret.scenario)).size} scenarios), the upstream key, and the marker every message content carries`);
  t.ok(linesByScenario.has('6-isolation-and-logs'), 'the logs of this scenario were searched');
  t.ok(keysRecorded >= 5, 'with the keys it used');
  t.same(leaks.slice(0, 30), [], `no log line holds a secret or a message content (${leaks.length} found)`);
  if (leaks.length === 0) removeRunDirectory();
  else t.comment(`the logs are kept in ${runDirectory()}`);
});
