// An UPSTREAMS_FILE for a test: the upstreams written as JSON to a directory of its own, removed
// at teardown.
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import type { Teardown } from './teardown.ts';

/** Writes `{ upstreams }` to a new file and returns its path. */
export async function upstreamsFile(t: Teardown, upstreams: unknown[]): Promise<string> {
  const directory = await mkdtemp(path.join(tmpdir(), 'gateway-upstreams-'));
  t.teardown(() => rm(directory, { recursive: true, force: true }));
  const file = path.join(directory, 'upstreams.json');
  await writeFile(file, JSON.stringify({ upstreams }));
  return file;
}
