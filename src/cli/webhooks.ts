// gateway webhooks add | list | remove | rotate-secret
import type { Db } from '../db/pool.ts';
import { addEndpoint, listEndpoints, removeEndpoint, rotateSecret, type WebhookSettings } from '../webhooks/endpoints.ts';
import { CommandError, table } from './output.ts';

export async function addWebhookCommand(
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
    'delivery with it (Standard Webhooks; see "Webhooks" in the README).',
  ].join('\n');
}

export async function listWebhooksCommand(db: Db, options: { project?: string; json: boolean }): Promise<string> {
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

export async function removeWebhookCommand(db: Db, id: string, options: { json: boolean }): Promise<string> {
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

export async function rotateWebhookSecretCommand(
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
