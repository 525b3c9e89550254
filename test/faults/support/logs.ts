// Searching captured logs for what must never be logged: the API keys and signing secrets the
// suite created (whole, or without their prefix), the upstream key, anything shaped like a key
// or a bearer credential, and the marker every message content carries.
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { CONTENT_MARKER, recordedSecrets, UPSTREAM_API_KEY } from './run.ts';

export interface LogSearch {
  /** "file:line: what", for each line holding something it must not. */
  leaks: string[];
  files: number;
  /** Lines searched, by the scenario that wrote them. */
  linesByScenario: Map<string, number>;
  secretsSearched: number;
}

export function searchLogs(files: string[]): LogSearch {
  const secrets = recordedSecrets();
  const needles = [
    ...secrets.flatMap((secret) => {
      const rest = secret.value.replace(/^svc_(live|test|sig)_/, '');
      return [{ kind: secret.kind, value: secret.value }, ...(rest !== secret.value ? [{ kind: `${secret.kind} without its prefix`, value: rest }] : [])];
    }),
    { kind: 'the upstream key', value: UPSTREAM_API_KEY },
    { kind: 'message content', value: CONTENT_MARKER },
  ];
  const shapes = [
    { kind: 'something shaped like an API key or signing secret', pattern: /svc_(live|test|sig)_[A-Za-z0-9]{8,}/ },
    { kind: 'a bearer credential', pattern: /Bearer [A-Za-z0-9_-]{16,}/i },
  ];
  const leaks: string[] = [];
  const linesByScenario = new Map<string, number>();
  for (const file of files) {
    const name = path.basename(file);
    const scenario = name.split('.')[0]!;
    const lines = readFileSync(file, 'utf8').split('\n').filter(Boolean);
    linesByScenario.set(scenario, (linesByScenario.get(scenario) ?? 0) + lines.length);
    lines.forEach((line, index) => {
      for (const needle of needles) if (line.includes(needle.value)) leaks.push(`${name}:${index + 1}: ${needle.kind}`);
      for (const shape of shapes) if (shape.pattern.test(line)) leaks.push(`${name}:${index + 1}: ${shape.kind}`);
    });
  }
  return { leaks, files: files.length, linesByScenario, secretsSearched: secrets.length };
}
