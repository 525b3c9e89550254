// Fault 6: reads across projects and modes, then what the logs of the whole suite hold.
// 100 requests (50 test-mode, 50 live) are read with keys of the other mode and of another
// project: every read is a 404 request_not_found, answered exactly as an unknown id is. Then
// every line logged by every process the suite started (each scenario's gateway processes and
// its own Postgres, kept in the run's log directory) is searched for API keys, signing secrets,
// the upstream key and message contents: none may appear.
import t from 'tap';
import { newRequestId } from '../../src/ids.ts';
import { completionFor, startFakeUpstream } from '../helpers/upstream.ts';
import { inBatches } from '../helpers/concurrency.ts';
import { call, tally, type Call } from './support/client.ts';
import { faultContext } from './support/context.ts';
import { waitUntilTerminal } from './support/rows.ts';
import { searchLogs } from './support/logs.ts';
import { logFiles, markLogsClean, privateContent, runDirectory, UPSTREAM_API_KEY } from './support/run.ts';

const SCENARIO = '6-isolation-and-logs';

t.test('cross-project and cross-mode reads of 100 ids are all 404 request_not_found, indistinguishable from unknown ids', async (t) => {
  const upstream = await startFakeUpstream(t, (received) => ({ status: 200, json: completionFor(received.body) }));
  const faults = await faultContext(t, SCENARIO);
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
  const ended = await waitUntilTerminal(faults.pool, [...testIds, ...liveIds], 30_000);
  t.same(ended.byStatus, { completed: 100 }, 'and completed');
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
  // Every scenario searched the run's logs when it ended; here they are searched all together
  // once more: those of the scenarios that ran before this one or are running beside it, and
  // this one's.
  const search = searchLogs(logFiles());
  t.comment(`searched ${search.files} log files: ${[...search.linesByScenario].map(([scenario, lines]) => `${scenario} ${lines} lines`).join(', ')}`);
  t.comment(`for ${search.secretsSearched} recorded API keys and signing secrets, the upstream key, and the marker every message content carries`);
  t.ok(search.linesByScenario.has(SCENARIO), 'the logs of this scenario were among them');
  t.same(search.leaks.slice(0, 30), [], `no log line holds a secret or a message content (${search.leaks.length} found)`);
  if (search.leaks.length === 0 && t.passing()) markLogsClean(SCENARIO);
  else t.comment(`the logs are kept in ${runDirectory()}`);
});
