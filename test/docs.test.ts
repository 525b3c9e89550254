// The documentation stays true to the code where a test can tell: docs/settings.md lists exactly
// the variables src/config.ts reads, with the defaults and bounds it applies; docs/operations.md
// exactly the metrics src/metrics.ts defines, with their types and labels; the worked examples of
// signing.md and webhooks.md sign as the code does; every link between the repository's
// documents leads to a file that exists and, for a #section, to a heading it has; and no file
// sends a reader outside the repository.
import { existsSync } from 'node:fs';
import { readdir, readFile } from 'node:fs/promises';
import path from 'node:path';
import { Webhook } from 'standardwebhooks';
import t from 'tap';
import { sha256Hex, signRequest, signWebhook } from '../src/client/index.ts';
import { ConfigError, loadConfig } from '../src/config.ts';
import { signingKey, verifySignature } from '../src/keys/signatures.ts';
import { Metrics } from '../src/metrics.ts';

const root = new URL('..', import.meta.url).pathname;
const read = (file: string) => readFile(path.join(root, file), 'utf8');

t.test('docs/settings.md has a row for every variable src/config.ts reads, and none other', async (t) => {
  const source = await read('src/config.ts');
  const start = source.indexOf('const Environment = v.object({');
  t.ok(start >= 0, 'src/config.ts declares its variables in Environment');
  const block = source.slice(start, source.indexOf('\n});', start));
  const readVariables = [...block.matchAll(/^ {2}([A-Z][A-Z0-9_]*):/gm)].map((match) => match[1]!);
  t.ok(readVariables.length >= 40, `${readVariables.length} variables read`);

  const settings = await read('docs/settings.md');
  const table = settings.slice(settings.indexOf('\n## All settings\n'), settings.indexOf('\n## ', settings.indexOf('\n## All settings\n') + 1));
  const documented = [...table.matchAll(/^\| `([A-Z][A-Z0-9_]*)` \|/gm)].map((match) => match[1]!);

  t.same([...documented].sort(), [...new Set(documented)].sort(), 'each variable has one row');
  t.same([...documented].sort(), [...readVariables].sort(), 'the rows are the variables config.ts reads');
});

/** GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes. */
function anchorOf(heading: string): string {
  return heading.trim().toLowerCase().replace(/[^\p{L}\p{N}\s_-]/gu, '').replace(/\s/g, '-');
}

async function anchorsOf(file: string): Promise<Set<string>> {
  const text = (await read(file)).replace(/```[\s\S]*?```/g, '');
  const anchors = new Set<string>();
  for (const match of text.matchAll(/^#{1,6} (.+)$/gm)) {
    const base = anchorOf(match[1]!);
    let anchor = base;
    for (let n = 1; anchors.has(anchor); n++) anchor = `${base}-${n}`;
    anchors.add(anchor);
  }
  return anchors;
}

t.test('every link between the documents leads somewhere', async (t) => {
  const documents = [
    'README.md',
    'src/client/README.md',
    ...(await readdir(path.join(root, 'docs'))).filter((file) => file.endsWith('.md')).map((file) => `docs/${file}`),
  ];
  t.ok(documents.length >= 10, `${documents.length} documents`);
  for (const document of documents) {
    const text = (await read(document)).replace(/```[\s\S]*?```/g, '');
    for (const match of text.matchAll(/\]\(([^)\s]+)\)/g)) {
      const link = match[1]!;
      if (/^[a-z]+:/.test(link)) continue;
      const [target = '', anchor] = link.split('#');
      const file = target === '' ? document : path.normalize(path.join(path.dirname(document), target));
      t.ok(existsSync(path.join(root, file)), `${document}: ${link} (${file} exists)`);
      if (anchor !== undefined && file.endsWith('.md')) {
        t.ok((await anchorsOf(file)).has(anchor), `${document}: ${link} (${file} has #${anchor})`);
      }
    }
  }
});

/** The text of the first fenced block after `marker` in `text` (without its fences). */
function blockAfter(text: string, marker: string): string {
  const at = text.indexOf(marker);
  if (at < 0) throw new Error(`no "${marker}" in the document`);
  const match = /```[a-z]*\n([\s\S]*?)\n```/.exec(text.slice(at));
  if (!match) throw new Error(`no block after "${marker}"`);
  return match[1]!;
}

/** The first `code` span after `marker` in `text`. */
function codeAfter(text: string, marker: string): string {
  const at = text.indexOf(marker);
  if (at < 0) throw new Error(`no "${marker}" in the document`);
  return /`([^`]+)`/.exec(text.slice(at + marker.length))![1]!;
}

t.test("signing.md's worked example is what the client library signs", async (t) => {
  const text = await read('docs/signing.md');
  const example = text.slice(text.indexOf('### A worked example'));
  const secret = codeAfter(example, 'signing secret');
  const body = codeAfter(example, 'the body');
  const [version, timestamp, nonce, method, path, bodySha256] = blockAfter(example, 'with nonce').split('\n');
  const header = blockAfter(example, 'signs to').replace(/^Svc-Signature: /, '');

  t.equal(version, 'v1');
  t.equal(bodySha256, await sha256Hex(body), 'the last line is the SHA-256 of the body');
  const signed = await signRequest({ signingSecret: secret, method: method!, path: path!, body, timestamp: Number(timestamp), nonce: nonce! });
  t.equal(signed.header, header, 'the header is the one the client library makes');
  t.doesNotThrow(
    () => verifySignature(header, { method: method!, path: path!, body: Buffer.from(body) }, signingKey(secret), Number(timestamp)),
    'the gateway accepts it',
  );
});

t.test("webhooks.md's signature example is what the gateway and standardwebhooks sign", async (t) => {
  const text = await read('docs/webhooks.md');
  const example = text.slice(text.indexOf('For example, with the secret'));
  const secret = codeAfter(example, 'with the secret');
  const id = codeAfter(example, 'the id');
  const timestamp = Number(codeAfter(example, 'the timestamp'));
  const body = blockAfter(example, 'the body');
  const signature = codeAfter(example, 'the signature is');

  t.equal(await signWebhook(secret, id, timestamp, body), signature, 'the signature is the one the gateway makes');
  t.equal(new Webhook(secret).sign(id, new Date(timestamp * 1000), body), signature, 'standardwebhooks signs it alike');
});

t.test("docs/operations.md's table of metrics has every metric the gateway defines, with its type and labels", async (t) => {
  const metrics = new Metrics();
  // The gauges a process adds for what it runs: all of them, as a process of role all with a worker.
  metrics.watchWaiters({ size: 0 });
  metrics.watchDispatcher({ inFlight: () => 0 });
  metrics.watchAnswerMemory({ reserved: 0, waiting: 0 });
  metrics.watchQueue(async () => []);
  metrics.watchWebhooks(async () => 0);
  const defined = new Map<string, { type: string; labels: string[] }>();
  const defaults = new Set<string>();
  for (const metric of metrics.registry.getMetricsAsArray() as unknown as { name: string; type: string; labelNames: string[] }[]) {
    const prefix = /^gateway_(process|nodejs)_/.exec(metric.name);
    if (prefix) defaults.add(`gateway_${prefix[1]}_*`);
    else defined.set(metric.name, { type: metric.type, labels: [...metric.labelNames].sort() });
  }
  t.ok(defined.size >= 25, `${defined.size} metrics of the gateway's own`);

  const operations = await read('docs/operations.md');
  const section = operations.slice(operations.indexOf('\n## Metrics\n'), operations.indexOf('\n## ', operations.indexOf('\n## Metrics\n') + 1));
  const documented = new Map<string, { type: string; labels: string[] }>();
  for (const row of section.matchAll(/^\| `(gateway_[a-z_]+)` \| (\w*) \|([^|]*)\|/gm)) {
    documented.set(row[1]!, { type: row[2]!, labels: [...row[3]!.matchAll(/`([a-z_]+)`/g)].map((label) => label[1]!).sort() });
  }
  t.same([...documented.keys()].sort(), [...defined.keys()].sort(), 'a row for each metric, and none other');
  for (const [name, metric] of defined) {
    if (documented.has(name)) t.same(documented.get(name), metric, `${name}: its type and labels`);
  }
  for (const prefix of defaults) t.match(section, `\`${prefix}\``, `prom-client's default metrics (${prefix}) are named`);
});

t.test('nothing in the repository sends a reader to documents outside it', async (t) => {
  // The product's specification and the decisions behind it are kept beside the repository, not
  // in it: users never see them, so no file may name them or their folder.
  const outside = /\b(?:SPEC|CONTRACT)\.md\b|(?<![\w.-])shared\//i;
  const skipped = new Set(['.git', 'node_modules', '.data', '.tap', 'dist']);
  const files: string[] = [];
  const walk = async (dir: string): Promise<void> => {
    for (const entry of await readdir(path.join(root, dir), { withFileTypes: true })) {
      const file = path.join(dir, entry.name);
      if (entry.isDirectory()) {
        if (!skipped.has(entry.name)) await walk(file);
      } else if (/\.(md|ts|js|json|sql|ya?ml|sh)$|^Makefile$/.test(entry.name) && entry.name !== 'package-lock.json') {
        files.push(file);
      }
    }
  };
  await walk('.');
  t.ok(files.length >= 100, `${files.length} files read`);
  const naming: string[] = [];
  for (const file of files) {
    (await read(file)).split('\n').forEach((line, index) => {
      if (outside.test(line)) naming.push(`${file}:${index + 1}: ${line.trim()}`);
    });
  }
  t.same(naming, [], 'no line names one');
});

/** The rows of docs/settings.md's table: variable, default and accepted values, as written. */
async function settingsRows(): Promise<{ name: string; fallback: string; accepted: string }[]> {
  const settings = await read('docs/settings.md');
  const table = settings.slice(settings.indexOf('\n## All settings\n'), settings.indexOf('\n## ', settings.indexOf('\n## All settings\n') + 1));
  return [...table.matchAll(/^\| `([A-Z][A-Z0-9_]*)` \| ([^|]*) \| ([^|]*) \|/gm)].map((row) => ({
    name: row[1]!,
    fallback: row[2]!.trim(),
    accepted: row[3]!.trim(),
  }));
}

/** The problems loadConfig finds with `name`'s own value (not those of the checks across settings). */
function ownProblems(name: string, value: string): string[] {
  try {
    loadConfig({ [name]: value });
    return [];
  } catch (error) {
    if (!(error instanceof ConfigError)) throw error;
    return error.message.split('\n').slice(1).map((line) => line.trim()).filter((line) => line.startsWith(`${name} must`) || line.startsWith(`${name}:`));
  }
}

t.test("docs/settings.md's defaults and accepted values are the ones src/config.ts applies", async (t) => {
  const rows = await settingsRows();
  t.ok(rows.length >= 40, `${rows.length} settings`);
  const defaults = loadConfig({});
  for (const { name, fallback, accepted } of rows) {
    // The default, set explicitly, changes nothing; (unset) is also what an empty value gives.
    const literal = /^`([^`]+)`$/.exec(fallback)?.[1] ?? /^\(from `[A-Z_]+`: (\d+)\)$/.exec(fallback)?.[1];
    if (fallback === '(unset)') {
      t.same(loadConfig({ [name]: '' }), defaults, `${name}: empty is unset`);
    } else if (literal !== undefined) {
      t.same(loadConfig({ [name]: literal }), defaults, `${name}: ${literal} is the default`);
      t.not(ownProblems(name, ''), [], `${name}: empty is refused`);
    }
    const range = /^(\d+) to (\d+)/.exec(accepted);
    const atLeast = /^at least (\d+)$/.exec(accepted);
    const durations = /^a duration, (\d+)([a-z]+) to (\d+)([a-z]+)$/.exec(accepted);
    const choices = /^`[^`]+`(, `[^`]+`)+$/.test(accepted) ? [...accepted.matchAll(/`([^`]+)`/g)].map((match) => match[1]!) : undefined;
    if (range || atLeast) {
      const min = Number((range ?? atLeast)![1]);
      t.same(ownProblems(name, String(min)), [], `${name}: ${min} is accepted`);
      if (min > 0) t.not(ownProblems(name, String(min - 1)), [], `${name}: ${min - 1} is refused`);
      if (range) {
        const max = Number(range[2]);
        t.same(ownProblems(name, String(max)), [], `${name}: ${max} is accepted`);
        t.not(ownProblems(name, String(max + 1)), [], `${name}: ${max + 1} is refused`);
      }
    } else if (durations) {
      const unit = { ms: 1, s: 1_000, m: 60_000, h: 3_600_000, d: 86_400_000 } as Record<string, number>;
      const min = Number(durations[1]) * unit[durations[2]!]!;
      const max = Number(durations[3]) * unit[durations[4]!]!;
      t.same(ownProblems(name, `${durations[1]}${durations[2]}`), [], `${name}: ${durations[1]}${durations[2]} is accepted`);
      t.not(ownProblems(name, String(min - 1)), [], `${name}: ${min - 1} ms is refused`);
      t.same(ownProblems(name, `${durations[3]}${durations[4]}`), [], `${name}: ${durations[3]}${durations[4]} is accepted`);
      t.not(ownProblems(name, String(max + 1)), [], `${name}: ${max + 1} ms is refused`);
    } else if (choices) {
      for (const choice of choices) t.same(ownProblems(name, choice), [], `${name}: ${choice} is accepted`);
      t.not(ownProblems(name, 'other'), [], `${name}: another value is refused`);
    }
  }
});
