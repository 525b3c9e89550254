// UPSTREAMS_FILE: its format, its checks, and routing a model to an upstream.
import { chmodSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import t, { type Test } from 'tap';
import {
  defaultUpstream,
  loadUpstreamsFile,
  deploymentsOf,
  upstreamModel,
  UpstreamsFileError,
  type Upstream,
} from '../../src/upstream/upstreams.ts';
import { randomBase62 } from '../../src/ids.ts';
import { runCli } from '../helpers/cli.ts';
import { createTestDatabase } from '../helpers/database.ts';

const directory = mkdtempSync(path.join(tmpdir(), 'gateway-upstreams-'));
t.teardown(() => rmSync(directory, { recursive: true, force: true }));

let files = 0;
function file(name: string, content: unknown): string {
  const filePath = path.join(directory, `${++files}-${name}`);
  writeFileSync(filePath, typeof content === 'string' ? content : JSON.stringify(content, null, 2));
  return filePath;
}

const env = { OPENAI_API_KEY: 'sk-openai-secret', OTHER_KEY: 'sk-other-secret' };

const valid = {
  upstreams: [
    {
      name: 'openai',
      base_url: 'https://api.openai.com/v1/',
      api_key_env: 'OPENAI_API_KEY',
      models: ['gpt-4o', 'gpt-4o-mini', 'o3*'],
      limits: { max_concurrent: 500, requests_per_minute: 5000, tokens_per_minute: 800000 },
    },
    { name: 'local', base_url: 'http://127.0.0.1:8000/v1', models: ['*'] },
  ],
};

const validYaml = `
# The same upstreams as the JSON file.
upstreams:
  - name: openai
    base_url: https://api.openai.com/v1/
    api_key_env: OPENAI_API_KEY
    models: [gpt-4o, gpt-4o-mini, "o3*"]
    limits:
      max_concurrent: 500
      requests_per_minute: 5000
      tokens_per_minute: 800000
  - name: local
    base_url: http://127.0.0.1:8000/v1
    models:
      - "*"
`;

/** The message of the UpstreamsFileError that loading `content` throws. */
function problemsOf(t: Test, content: unknown, name = 'upstreams.json', environment: Record<string, string | undefined> = env): string {
  try {
    loadUpstreamsFile(file(name, content), environment);
  } catch (error) {
    t.type(error, UpstreamsFileError);
    return (error as Error).message;
  }
  t.fail('the file was accepted');
  return '';
}

/** `valid` with its first upstream changed. */
function withFirst(change: Record<string, unknown>): unknown {
  return { upstreams: [{ ...valid.upstreams[0], ...change }, valid.upstreams[1]] };
}

t.test('a JSON file and the same as YAML give the same upstreams', async (t) => {
  const fromJson = loadUpstreamsFile(file('upstreams.json', valid), env);
  const fromYaml = loadUpstreamsFile(file('upstreams.yaml', validYaml), env);
  t.same(fromJson, [
    {
      name: 'openai',
      baseUrl: 'https://api.openai.com/v1',
      apiKey: 'sk-openai-secret',
      models: ['gpt-4o', 'gpt-4o-mini', 'o3*'],
      renames: {},
      limits: { maxConcurrent: 500, requestsPerMinute: 5000, tokensPerMinute: 800000 },
    },
    {
      name: 'local',
      baseUrl: 'http://127.0.0.1:8000/v1',
      apiKey: undefined,
      models: ['*'],
      renames: {},
      limits: { maxConcurrent: undefined, requestsPerMinute: undefined, tokensPerMinute: undefined },
    },
  ]);
  t.strictSame(fromYaml, fromJson);
  t.strictSame(loadUpstreamsFile(file('upstreams.YML', validYaml), env), fromJson, '.yml, in any case, is YAML too');
  t.ok(Object.isFrozen(fromJson) && Object.isFrozen(fromJson[0]) && Object.isFrozen(fromJson[0]!.models) && Object.isFrozen(fromJson[0]!.limits));
});

t.test('api keys come from the variables that api_key_env names', async (t) => {
  const upstreams = loadUpstreamsFile(
    file('upstreams.json', {
      upstreams: [
        { name: 'a', base_url: 'https://a.example/v1', api_key_env: 'OTHER_KEY', models: ['m1'] },
        { name: 'b', base_url: 'https://b.example/v1', api_key_env: 'OPENAI_API_KEY', models: ['m2'] },
      ],
    }),
    env,
  );
  t.same(upstreams.map((upstream) => upstream.apiKey), ['sk-other-secret', 'sk-openai-secret']);
});

t.test('a model is served by every upstream that lists it, exactly or by prefix, in the file\'s order', async (t) => {
  const upstreams = loadUpstreamsFile(file('upstreams.json', valid), env);
  const names = (model: string, list = upstreams) => deploymentsOf(list, model).map((upstream) => upstream.name);
  t.same(names('gpt-4o'), ['openai', 'local'], 'exact name, then "*"');
  t.same(names('o3-mini'), ['openai', 'local'], 'prefix pattern');
  t.same(names('o3'), ['openai', 'local'], 'a prefix pattern matches the bare prefix');
  t.same(names('gpt-4o-2024-08-06'), ['local'], 'an exact name is not a prefix: only "*"');
  t.same(names('llama-3'), ['local'], '"*" serves every model');

  const first = loadUpstreamsFile(
    file('upstreams.json', {
      upstreams: [
        { name: 'first', base_url: 'https://a.example', models: ['gpt-*'] },
        { name: 'second', base_url: 'https://b.example', models: ['gpt-4o'] },
      ],
    }),
    env,
  );
  t.same(names('gpt-4o', first), ['first', 'second'], 'the file order decides, not how specific a pattern is');
  t.same(names('claude', first), [], 'no upstream serves the model');
  t.same(names('gpt-4o', []), []);
});

t.test('a models entry may rename a model: one public name, each provider\'s own name for it', async (t) => {
  const upstreams = loadUpstreamsFile(
    file('upstreams.yaml', [
      'upstreams:',
      '  - name: azure',
      '    base_url: https://azure.example/openai',
      '    models:',
      '      - gpt-4o: my-gpt-4o-deployment',
      '      - o3-*',
      '  - name: openai',
      '    base_url: https://api.openai.com/v1',
      '    models: [gpt-4o]',
    ].join('\n')),
    env,
  );
  t.same(upstreams[0]!.models, ['gpt-4o', 'o3-*'], 'the public names are what routes');
  t.same(deploymentsOf(upstreams, 'gpt-4o').map((upstream) => upstream.name), ['azure', 'openai']);
  t.equal(upstreamModel(upstreams[0]!, 'gpt-4o'), 'my-gpt-4o-deployment', 'azure calls it by its deployment name');
  t.equal(upstreamModel(upstreams[1]!, 'gpt-4o'), 'gpt-4o', 'openai by the name itself');
  t.equal(upstreamModel(upstreams[0]!, 'o3-mini'), 'o3-mini', 'a model not renamed keeps its name');
  t.equal(upstreamModel(upstreams[0]!, 'toString'), 'toString', 'only the file\'s own entries rename');

  t.throws(
    () => loadUpstreamsFile(file('bad.json', { upstreams: [{ name: 'a', base_url: 'https://a.example', models: [{ 'gpt-*': 'x' }] }] }), env),
    /upstreams\[0\]\.models\[0\]\.gpt-\*: must be an exact model name to be renamed/,
  );
  t.throws(
    () => loadUpstreamsFile(file('bad.json', { upstreams: [{ name: 'a', base_url: 'https://a.example', models: [{ a: 'x', b: 'y' }] }] }), env),
    /upstreams\[0\]\.models\[0\]: must map one model name/,
  );
  t.throws(
    () => loadUpstreamsFile(file('bad.json', { upstreams: [{ name: 'a', base_url: 'https://a.example', models: [{ a: '' }] }] }), env),
    /upstreams\[0\]\.models\[0\]\.a: must be 1 to 256 characters/,
  );
});

t.test('without a file, one upstream named default serves every model', async (t) => {
  const upstream: Upstream = defaultUpstream('https://api.openai.com/v1/', 'sk-key');
  t.same(upstream, {
    name: 'default',
    baseUrl: 'https://api.openai.com/v1',
    apiKey: 'sk-key',
    models: ['*'],
    renames: {},
    limits: { maxConcurrent: undefined, requestsPerMinute: undefined, tokensPerMinute: undefined },
  });
  t.same(deploymentsOf([upstream], 'anything'), [upstream]);
  t.ok(Object.isFrozen(upstream));
});

t.test('each problem is named by its path in one message', async (t) => {
  const cases: [string, unknown, RegExp][] = [
    ['unknown key', withFirst({ api_key: 'sk-inline' }), /upstreams\[0\]\.api_key: is not a known key/],
    ['unknown limit', withFirst({ limits: { rpm: 10 } }), /upstreams\[0\]\.limits\.rpm: is not a known key/],
    ['unknown top-level key', { ...valid, default: 'openai' }, /\n  default: is not a known key/],
    ['missing key', withFirst({ base_url: undefined }), /upstreams\[0\]\.base_url: is required/],
    [
      'duplicate name',
      { upstreams: [...valid.upstreams, { ...valid.upstreams[1], base_url: 'http://elsewhere' }] },
      /upstreams\[2\]\.name: "local" is already the name of upstreams\[1\]/,
    ],
    ['reserved name', withFirst({ name: 'simulator' }), /upstreams\[0\]\.name: "simulator" is reserved for test mode/],
    ['bad name', withFirst({ name: 'OpenAI' }), /upstreams\[0\]\.name: must be 1 to 64 characters/],
    ['bad URL', withFirst({ base_url: 'api.openai.com/v1' }), /upstreams\[0\]\.base_url: must be an http or https URL/],
    ['not http', withFirst({ base_url: 'ftp://files.example/v1' }), /upstreams\[0\]\.base_url: must be an http or https URL/],
    ['* in the middle', withFirst({ models: ['gpt-4o', 'gpt-*-mini'] }), /upstreams\[0\]\.models\[1\]: may hold "\*" only as its last character/],
    ['two *', withFirst({ models: ['**'] }), /upstreams\[0\]\.models\[0\]: may hold "\*" only/],
    ['empty model', withFirst({ models: [''] }), /upstreams\[0\]\.models\[0\]: must be 1 to 256 characters/],
    ['empty models', withFirst({ models: [] }), /upstreams\[0\]\.models: must list at least one model/],
    ['no upstreams', { upstreams: [] }, /upstreams: must list at least one upstream/],
    ['not an object', [valid.upstreams], /\(top level\): must be an object/],
    ['limits not an object', withFirst({ limits: [10] }), /upstreams\[0\]\.limits: must be an object/],
    ['bad env name', withFirst({ api_key_env: 'sk-123' }), /upstreams\[0\]\.api_key_env: must be the name of an environment variable/],
    ['zero limit', withFirst({ limits: { requests_per_minute: 0 } }), /upstreams\[0\]\.limits\.requests_per_minute: must be a whole number of at least 1/],
    ['fractional limit', withFirst({ limits: { max_concurrent: 2.5 } }), /upstreams\[0\]\.limits\.max_concurrent: must be a whole number of at least 1/],
    ['limit as text', withFirst({ limits: { tokens_per_minute: '1000' } }), /upstreams\[0\]\.limits\.tokens_per_minute: must be a whole number of at least 1/],
    ['huge limit', withFirst({ limits: { tokens_per_minute: 20_000_000 } }), /upstreams\[0\]\.limits\.tokens_per_minute: must be at most 10000000/],
  ];
  for (const [label, content, expected] of cases) {
    const message = problemsOf(t, content);
    t.match(message, expected, label);
    t.match(message, /^Invalid upstreams file \/.*upstreams\.json:/, `${label}: names the file`);
  }
});

t.test('every problem in the file is listed, not only the first', async (t) => {
  const message = problemsOf(t, {
    upstreams: [
      { name: 'a', base_url: 'nowhere', models: ['x*y'], limits: { requests_per_minute: -1 } },
      { name: 'a', base_url: 'https://b.example', models: [] },
    ],
  });
  t.same(message.split('\n').slice(1), [
    '  upstreams[0].base_url: must be an http or https URL',
    '  upstreams[0].models[0]: may hold "*" only as its last character (a prefix pattern)',
    '  upstreams[0].limits.requests_per_minute: must be a whole number of at least 1',
    '  upstreams[1].models: must list at least one model',
    '  upstreams[1].name: "a" is already the name of upstreams[0]',
  ]);
});

t.test('a missing key variable is reported by its path, and no key is ever printed', async (t) => {
  const content = {
    upstreams: [
      { name: 'a', base_url: 'https://a.example', api_key_env: 'MISSING_KEY', models: ['*'] },
      { name: 'b', base_url: 'https://b.example', api_key_env: 'BLANK_KEY', models: ['*'] },
      { name: 'c', base_url: 'nowhere', api_key_env: 'OPENAI_API_KEY', models: ['*'] },
    ],
  };
  const environment = { ...env, BLANK_KEY: '  ' };
  const message = problemsOf(t, content, 'upstreams.json', environment);
  t.match(message, /upstreams\[0\]\.api_key_env: names an environment variable that is not set or empty/);
  t.match(message, /upstreams\[1\]\.api_key_env: names an environment variable that is not set or empty/);
  t.notMatch(message, /upstreams\[2\]\.api_key_env/, 'a set variable is no problem');
  for (const value of Object.values(env)) t.notOk(message.includes(value), 'no key in the message');
});

t.test('a key written in api_key_env in place of a variable\'s name is not printed, by the check nor by the command line', async (t) => {
  // Many providers' keys are letters, digits and "_" only: such a key passes for a variable's name.
  const key = `gsk_${randomBase62(40)}`;
  const content = { upstreams: [{ name: 'a', base_url: 'https://a.example', api_key_env: key, models: ['*'] }] };
  const message = problemsOf(t, content);
  t.match(message, /upstreams\[0\]\.api_key_env: names an environment variable that is not set or empty/);
  t.notOk(message.includes(key), 'the key is not in the message');

  const cli = await runCli(['migrate'], { UPSTREAMS_FILE: file('upstreams.json', content) });
  t.equal(cli.code, 1);
  t.match(cli.stderr, /upstreams\[0\]\.api_key_env/);
  t.notOk(`${cli.stdout}${cli.stderr}`.includes(key), 'gateway prints no key');
});

t.test('an upstream URL with a user name or password is refused without showing it, rather than listed by gateway upstreams', async (t) => {
  // undici sends no credentials of the URL: they would reach no upstream, only what prints the URL.
  const password = `pw${randomBase62(24)}`;
  const databaseUrl = await createTestDatabase(t);
  const fromFile = file('upstreams.json', {
    upstreams: [{ name: 'a', base_url: `https://acct:${password}@a.example/v1`, models: ['*'] }],
  });
  const cases: [string, Record<string, string>, RegExp][] = [
    ['UPSTREAMS_FILE', { UPSTREAMS_FILE: fromFile }, /upstreams\[0\]\.base_url: may not hold a user name or password/],
    ['UPSTREAM_BASE_URL', { UPSTREAM_BASE_URL: `https://acct:${password}@b.example/v1` }, /UPSTREAM_BASE_URL may not hold a user name or password/],
  ];
  for (const [where, settings, said] of cases) {
    const result = await runCli(['upstreams', '--json'], { DATABASE_URL: databaseUrl, ...settings });
    t.equal(result.code, 1, `${where}: refused`);
    t.match(result.stderr, said, `${where}: says why`);
    t.notOk(`${result.stdout}${result.stderr}`.includes(password), `${where}: the password is not printed`);
  }
});

t.test('api_key_env may not name one of the gateway\'s own variables, reported with the file\'s other problems', async (t) => {
  const own = [
    'SECRET_ENCRYPTION_KEY', 'SECRET_ENCRYPTION_KEYS', 'SECRET_ENCRYPTION_KEY_OLD', 'DATABASE_URL', 'METRICS_TOKEN',
    'GATEWAY_SIGNING_SECRET', 'GATEWAY_API_KEY', 'database_url',
  ];
  const content = {
    upstreams: [
      ...own.map((name, index) => ({ name: `u${index}`, base_url: 'https://u.example', api_key_env: name, models: ['*'] })),
      { name: 'fine', base_url: 'nowhere', api_key_env: 'OPENAI_API_KEY', models: ['*'] },
    ],
  };
  const environment = { ...env, ...Object.fromEntries(own.map((name) => [name, `value-of-${name}`])) };
  const message = problemsOf(t, content, 'upstreams.json', environment);
  t.same(message.split('\n').slice(1), [
    ...own.map((name, index) =>
      `  upstreams[${index}].api_key_env: names ${name}, a variable of the gateway's own; an upstream's key must be in a variable of its own (it is sent to the upstream)`,
    ),
    `  upstreams[${own.length}].base_url: must be an http or https URL`,
  ]);
  for (const value of Object.values(environment)) t.notOk(message.includes(value), 'no value in the message');

  const unset = problemsOf(t, { upstreams: [{ name: 'a', base_url: 'https://a.example', api_key_env: 'METRICS_TOKEN', models: ['*'] }] });
  t.same(unset.split('\n').slice(1), [
    "  upstreams[0].api_key_env: names METRICS_TOKEN, a variable of the gateway's own; an upstream's key must be in a variable of its own (it is sent to the upstream)",
  ], 'one message, set or not');
});

t.test('a file that cannot be read or parsed is named, with the position but not the text', async (t) => {
  t.throws(() => loadUpstreamsFile(path.join(directory, 'absent.json'), env), {
    name: 'UpstreamsFileError',
    message: /^Invalid upstreams file \/.*absent\.json: cannot be read \(ENOENT\)$/,
  });
  t.throws(() => loadUpstreamsFile(directory, env), { message: /cannot be read \(EISDIR\)$/ }, 'a directory');
  if (process.getuid?.() !== 0) {
    const unreadable = file('unreadable.json', valid);
    chmodSync(unreadable, 0o000);
    t.throws(() => loadUpstreamsFile(unreadable, env), { message: /cannot be read \(EACCES\)$/ });
  }

  const secretish = 'sk-in-the-file';
  const badLine = `    { "name": "${secretish}", "base_url": nope }`;
  const badJson = problemsOf(t, `{\n  "upstreams": [\n${badLine}\n  ]\n}`);
  t.match(badJson, new RegExp(`upstreams\\.json: not valid JSON: Unexpected token '\\w' at line 3, column ${badLine.indexOf('nope') + 1}$`));
  t.notOk(badJson.includes(secretish), 'the text around the fault is not quoted');
  t.match(problemsOf(t, '{"upstreams": [],}'), /not valid JSON: Expected double-quoted property name at line 1, column 18$/);
  t.match(problemsOf(t, ''), /not valid JSON: Unexpected end of JSON input$/);

  const badYaml = problemsOf(t, `upstreams:\n  - name: ${secretish}\n    name: again\n`, 'upstreams.yaml');
  t.match(badYaml, /upstreams\.yaml: not valid YAML: Map keys must be unique at line 3, column 5$/);
  t.notOk(badYaml.includes(secretish), 'the text around the fault is not quoted');
  t.match(problemsOf(t, '', 'empty.yml'), /empty\.yml:\n {2}\(top level\): must be an object/, 'an empty YAML file holds no upstreams');
});
