// gateway keys create | list | revoke | reencrypt
import type { Db } from '../db/pool.ts';
import { Deadline, formatDuration } from '../duration.ts';
import type { KeyMode } from '../ids.ts';
import { reencryptSecrets } from '../keys/reencryption.ts';
import { createKey, listKeys, revokeKey } from '../keys/service.ts';
import { CommandError, table } from './output.ts';
import * as v from 'valibot';
import type { AdminCommand } from '../main.ts';
import { parse, UsageError } from './args.ts';

async function createKeyCommand(
  db: Db,
  encryptionKey: Buffer | undefined,
  options: { project: string; mode: KeyMode; deadlineMs: number | undefined; requestDeadlineMs: number; json: boolean },
): Promise<string> {
  const created = await createKey(db, encryptionKey, options);
  if (options.json) {
    return JSON.stringify({
      id: created.id,
      project: created.project,
      mode: created.mode,
      api_key: created.api_key,
      signing_secret: created.signing_secret,
    });
  }
  return [
    `Created a ${created.mode} key for project "${created.project}" (id ${created.id}).`,
    '',
    `  API key:         ${created.api_key}`,
    `  Signing secret:  ${created.signing_secret}`,
    ...(options.deadlineMs === undefined ? [] : [`  Deadline:        ${deadlineShown(options.deadlineMs, options.requestDeadlineMs)}`]),
    '',
    'Both are shown this once and cannot be recovered: store them now.',
  ].join('\n');
}

/**
 * The deadline a key's requests get: its own, cut to REQUEST_DEADLINE when that is shorter (as
 * each request is accepted; the key keeps its own, which a longer REQUEST_DEADLINE lets apply).
 */
function deadlineShown(deadlineMs: number, requestDeadlineMs: number): string {
  const why = 'its requests fail if not finished by then';
  if (deadlineMs <= requestDeadlineMs) return `${formatDuration(deadlineMs)} (${why})`;
  return `${formatDuration(requestDeadlineMs)} (REQUEST_DEADLINE, shorter than the ${formatDuration(deadlineMs)} given; ${why})`;
}

async function listKeysCommand(db: Db, options: { project?: string; json: boolean }): Promise<string> {
  const keys = await listKeys(db, options.project);
  const rows = keys.map((key) => ({
    id: key.id,
    project: key.project,
    mode: key.mode,
    key: `svc_${key.mode}_...${key.key_hint}`,
    created_at: key.created_at,
    revoked_at: key.revoked_at,
    status: key.revoked_at ? 'revoked' : 'active',
    // null: the server's REQUEST_DEADLINE.
    deadline: key.request_deadline_ms === null ? null : formatDuration(key.request_deadline_ms),
    // null: made before keys recorded it, so it may have none (docs/operations.md, "Keys in memory").
    checksum: key.checksummed ? true : null,
  }));
  if (options.json) return JSON.stringify(rows);
  if (rows.length === 0) return 'No keys.';
  return table(
    rows.map((row) => ({ ...row, deadline: row.deadline ?? 'REQUEST_DEADLINE', checksum: row.checksum ? 'yes' : 'unknown' })),
    ['id', 'project', 'mode', 'key', 'status', 'deadline', 'checksum', 'created_at', 'revoked_at'],
  );
}

async function revokeKeyCommand(db: Db, id: string, options: { json: boolean }): Promise<string> {
  const key = await revokeKey(db, id);
  if (!key) throw new CommandError(`No key with id ${id}.`);
  if (options.json) return JSON.stringify({ id: key.id, project: key.project, mode: key.mode, revoked_at: key.revoked_at });
  return `Revoked key ${key.id} (${key.mode}, project "${key.project}") at ${key.revoked_at?.toISOString()}.`;
}

/** Every stored secret under the first of SECRET_ENCRYPTION_KEYS (see keys/reencryption.ts). */
async function reencryptKeysCommand(db: Db, encryptionKeys: readonly Buffer[], options: { json: boolean }): Promise<string> {
  const report = await reencryptSecrets(db, encryptionKeys);
  const { signingSecrets: keys, webhookEndpoints: endpoints, undecryptable } = report;
  const summary = options.json
    ? JSON.stringify({
        signing_secrets: keys,
        webhook_endpoints: endpoints,
        undecryptable,
      })
    : [
        `Signing secrets: ${keys.reencrypted} re-encrypted with the first key, ${keys.current} already were.`,
        `Webhook endpoints: ${endpoints.reencrypted} re-encrypted with the first key, ${endpoints.current} already were.`,
      ].join('\n');
  if (undecryptable.length > 0) {
    // Nothing of them is changed; the others are done, and the summary says so on standard
    // output as on success. The ids say which, never a secret.
    throw new CommandError(
      `None of the ${encryptionKeys.length} keys decrypts the secrets of: ${undecryptable.join(', ')}. ` +
        'Add the key they were stored with to SECRET_ENCRYPTION_KEYS and run this again.',
      { output: summary },
    );
  }
  return summary;
}

/** --deadline's milliseconds; a value that is not a deadline is a UsageError saying why. */
function parseDeadline(text: string): number {
  const parsed = v.safeParse(Deadline('--deadline'), text);
  if (!parsed.success) throw new UsageError(`${parsed.issues[0].message}.`);
  return parsed.output;
}

/** gateway keys create | list | revoke | reencrypt, from its arguments. */
export function parseKeysCommand(args: string[]): AdminCommand {
  const [subcommand, ...rest] = args;
  switch (subcommand) {
    case 'create': {
      const { values } = parse(rest, {
        project: { type: 'string' },
        mode: { type: 'string', default: 'live' },
        deadline: { type: 'string' },
        json: { type: 'boolean', default: false },
      });
      if (values.project === undefined) throw new UsageError('keys create needs --project <name>.');
      const mode = v.parse(v.picklist(['live', 'test'], '--mode must be live or test'), values.mode);
      const deadlineMs = values.deadline === undefined ? undefined : parseDeadline(values.deadline);
      return (db, { config }) =>
        createKeyCommand(db, config.secretEncryptionKeys[0], {
          project: values.project!,
          mode,
          deadlineMs,
          requestDeadlineMs: config.requestDeadlineMs,
          json: values.json!,
        });
    }
    case 'list': {
      const { values } = parse(rest, { project: { type: 'string' }, json: { type: 'boolean', default: false } });
      return (db) => listKeysCommand(db, { ...(values.project !== undefined ? { project: values.project } : {}), json: values.json! });
    }
    case 'revoke': {
      const { values, positionals } = parse(rest, { json: { type: 'boolean', default: false } }, true);
      if (positionals.length !== 1) throw new UsageError('keys revoke needs exactly one key id.');
      return (db) => revokeKeyCommand(db, positionals[0]!, { json: values.json! });
    }
    case 'reencrypt': {
      const { values } = parse(rest, { json: { type: 'boolean', default: false } });
      return (db, { config }) => reencryptKeysCommand(db, config.secretEncryptionKeys, { json: values.json! });
    }
    default:
      throw new UsageError('keys takes create, list, revoke or reencrypt.');
  }
}
