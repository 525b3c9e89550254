// BENCH_PROFILE=1: the gateway's processes run with --cpu-prof, and each phase's report names
// the functions that took the most CPU (self time). The .cpuprofile files stay in the run's
// directory for Chrome DevTools or speedscope.
import { readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';

interface ProfileNode {
  id: number;
  callFrame: { functionName: string; url: string; lineNumber: number };
}

interface Profile {
  nodes: ProfileNode[];
  samples: number[];
  timeDeltas: number[];
}

const ROOT = path.resolve(import.meta.dirname, '..');

/**
 * "top self time: 12% writev, 8% parse src/x.ts:10, ..." for the profiles of one phase's
 * processes (directories named <phase>-<role>-<n> under `directory`).
 */
export function summarizeProfiles(directory: string, phase: string, top = 8): string[] {
  let files: string[];
  try {
    files = readdirSync(directory, { recursive: true, encoding: 'utf8' }).filter(
      (file) => file.startsWith(`${phase}-`) && file.endsWith('.cpuprofile'),
    );
  } catch {
    return [`no CPU profile was written in ${directory}`];
  }
  return files.map((file) => {
    const profile = JSON.parse(readFileSync(path.join(directory, file), 'utf8')) as Profile;
    const selfTime = new Map<number, number>();
    profile.samples.forEach((node, index) => selfTime.set(node, (selfTime.get(node) ?? 0) + (profile.timeDeltas[index] ?? 0)));
    const byFunction = new Map<string, number>();
    let busy = 0;
    for (const node of profile.nodes) {
      const time = selfTime.get(node.id) ?? 0;
      const name = node.callFrame.functionName || '(anonymous)';
      if (name === '(idle)') continue;
      busy += time;
      const where = node.callFrame.url ? ` ${shorten(node.callFrame.url)}:${node.callFrame.lineNumber + 1}` : '';
      const key = `${name}${where}`;
      byFunction.set(key, (byFunction.get(key) ?? 0) + time);
    }
    const entries = [...byFunction]
      .sort((a, b) => b[1] - a[1])
      .slice(0, top)
      .map(([key, time]) => `${((time / busy) * 100).toFixed(1)}% ${key}`);
    return `profile ${path.relative(process.cwd(), path.join(directory, file))}: busy ${(busy / 1e6).toFixed(1)} s; top self time: ${entries.join(', ')}`;
  });
}

function shorten(url: string): string {
  const file = url.startsWith('file://') ? new URL(url).pathname : url;
  const relative = path.relative(ROOT, file);
  return relative.startsWith('node_modules/') ? relative.replace(/^node_modules\//, '') : relative;
}
