// gateway webhooks add | list | remove | rotate-secret
import type { Db } from '../db/pool.ts';
import { addEndpoint, listEndpoints, removeEndpoint, rotateSecret, type WebhookSettings } from '../webhooks/endpoints.ts';
import { CommandError, table } from './output.ts';
import type { AdminCommand } from '../main.ts';
import { parse, UsageError } from './args.ts';
import { WEBHOOK_ENDPOINT_ID } from '../ids.ts';

async function addWebhookCommand(
  db: Db,
  settings: WebhookSettings,
  options: { project: string; url: string; events?: string[]; json: boolean },
): Promise<string> {
  const created = await addEndpoint(db, settings, options);
  if (options.json) {
    return JSON.stringify({
      id: created.id,
      project: created.project,
      url: created.url,
      events: created.events,
      secret: created.secret,
    });
  }
  return [
    `Added webhook endpoint ${created.id} for project "${created.project}".`,
    '',
    `  URL:     ${created.url}`,
    `  Events:  ${created.events.join(', ')}`,
    `  Secret:  ${created.secret}`,
    '',
    'The secret is shown this once and cannot be recovered: store it now. Receivers verify each',
    'delivery with it (Standard Webhooks; see docs/webhooks.md).',
  ].join('\n');
}

async function listWebhooksCommand(db: Db, options: { project?: string; json: boolean }): Promise<string> {
  const endpoints = await listEndpoints(db, options.project);
  const rows = endpoints.map((endpoint) => ({
    id: endpoint.id,
    project: endpoint.project,
    url: endpoint.url,
    events: endpoint.events,
    status: endpoint.disabled_at ? 'disabled' : 'active',
    created_at: endpoint.created_at,
    previous_secret_expires_at: endpoint.previous_secret_expires_at,
    disabled_at: endpoint.disabled_at,
    disabled_reason: endpoint.disabled_reason,
  }));
  if (options.json) return JSON.stringify(rows);
  if (rows.length === 0) return 'No webhook endpoints.';
  return table(
    rows.map((row) => ({ ...row, events: row.events.join(',') })),
    ['id', 'project', 'url', 'events', 'status', 'created_at', 'disabled_reason'],
  );
}

async function removeWebhookCommand(db: Db, id: string, options: { json: boolean }): Promise<string> {
  const removed = await removeEndpoint(db, id);
  if (!removed) throw new CommandError(`No webhook endpoint with id ${id}.`);
  if (options.json) {
    return JSON.stringify({ id: removed.id, project: removed.project, url: removed.url, undelivered_messages: removed.undelivered_messages });
  }
  const dropped = removed.undelivered_messages;
  return (
    `Removed webhook endpoint ${removed.id} (project "${removed.project}", ${removed.url})` +
    (dropped > 0 ? `; its ${dropped} message${dropped === 1 ? '' : 's'} not yet delivered will not be.` : '.')
  );
}

async function rotateWebhookSecretCommand(
  db: Db,
  encryptionKey: Buffer | undefined,
  id: string,
  options: { json: boolean },
): Promise<string> {
  const rotated = await rotateSecret(db, encryptionKey, id);
  if (!rotated) throw new CommandError(`No webhook endpoint with id ${id}.`);
  const expires = rotated.previous_secret_expires_at;
  if (options.json) {
    return JSON.stringify({ id: rotated.endpoint.id, secret: rotated.secret, previous_secret_expires_at: expires });
  }
  return [
    `New secret for webhook endpoint ${rotated.endpoint.id} (project "${rotated.endpoint.project}"):`,
    '',
    `  Secret:  ${rotated.secret}`,
    '',
    `The previous secret keeps signing deliveries beside this one until ${expires.toISOString()};`,
    'switch your receiver to the new one before then. It is shown this once: store it now.',
  ].join('\n');
}

/** The one endpoint id of `webhooks <subcommand> <id>`; a UsageError for none, more, or one not shaped whe_... */
function endpointIdOf(subcommand: string, positionals: string[]): string {
  if (positionals.length !== 1) throw new UsageError(`webhooks ${subcommand} needs exactly one endpoint id.`);
  const id = positionals[0]!;
  if (!WEBHOOK_ENDPOINT_ID.test(id)) throw new UsageError(`webhooks ${subcommand}: ${id} is not an endpoint id (whe_...).`);
  return id;
}

/** gateway webhooks add | list | remove | rotate-secret, from its arguments. */
export function parseWebhooksCommand(args: string[]): AdminCommand {
  const [subcommand, ...rest] = args;
  switch (subcommand) {
    case 'add': {
      const { values } = parse(rest, {
        project: { type: 'string' },
        url: { type: 'string' },
        events: { type: 'string' },
        json: { type: 'boolean', default: false },
      });
      if (values.project === undefined || values.url === undefined) throw new UsageError('webhooks add needs --project <name> and --url <url>.');
      const events = values.events?.split(',').map((event) => event.trim()).filter(Boolean);
      return (db, { config }) =>
        addWebhookCommand(
          db,
          { encryptionKey: config.secretEncryptionKeys[0], allowPrivate: config.webhooks.allowPrivate },
          { project: values.project!, url: values.url!, json: values.json!, ...(events ? { events } : {}) },
        );
    }
    case 'list': {
      const { values } = parse(rest, { project: { type: 'string' }, json: { type: 'boolean', default: false } });
      return (db) => listWebhooksCommand(db, { ...(values.project !== undefined ? { project: values.project } : {}), json: values.json! });
    }
    case 'remove': {
      const { values, positionals } = parse(rest, { json: { type: 'boolean', default: false } }, true);
      const id = endpointIdOf('remove', positionals);
      return (db) => removeWebhookCommand(db, id, { json: values.json! });
    }
    case 'rotate-secret': {
      const { values, positionals } = parse(rest, { json: { type: 'boolean', default: false } }, true);
      const id = endpointIdOf('rotate-secret', positionals);
      return (db, { config }) => rotateWebhookSecretCommand(db, config.secretEncryptionKeys[0], id, { json: values.json! });
    }
    default:
      throw new UsageError('webhooks takes add, list, remove or rotate-secret.');
  }
}
