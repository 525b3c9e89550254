// The documentation stays true to the code where a test can tell: docs/settings.md lists exactly
// the variables src/config.ts reads, and every link between the repository's documents leads to a
// file that exists and, for a #section, to a heading it has.
import { existsSync } from 'node:fs';
import { readdir, readFile } from 'node:fs/promises';
import path from 'node:path';
import t from 'tap';

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
