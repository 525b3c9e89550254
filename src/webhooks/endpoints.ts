// Webhook endpoints: where a project's requests are reported when they end (docs/webhooks.md,
// "Adding an endpoint"). Adding one shows its signing secret once; it is then kept only encrypted with
// SECRET_ENCRYPTION_KEY, bound to the endpoint's id, as keys' signing secrets are. Rotating it
// keeps the old secret signing beside the new one for a day, so receivers can switch over.
import { randomBytes } from 'node:crypto';
import * as v from 'valibot';
import type { WebhookEvent } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import { newWebhookEndpointId } from '../ids.ts';
import { ensureProject } from '../keys/repository.ts';
import { encryptSecret } from '../keys/secrets.ts';
import { MissingEncryptionKeyError, ProjectName } from '../keys/service.ts';
import { ipLiteralOf, isAllowedScheme, isForbiddenAddress } from './address.ts';
import * as repository from './repository.ts';

const WEBHOOK_EVENTS: readonly WebhookEvent[] = ['request.completed', 'request.failed', 'request.cancelled'];

/** How long the secret replaced by a rotation keeps signing beside the new one. */
const SECRET_OVERLAP_MS = 24 * 60 * 60 * 1000;

// Standard Webhooks' secret format: whsec_ and the base64 of the key's bytes.
const SECRET_BYTES = 32;
const newWebhookSecret = () => `whsec_${randomBytes(SECRET_BYTES).toString('base64')}`;

export interface WebhookSettings {
  /** SECRET_ENCRYPTION_KEY: secrets cannot be stored without it. */
  encryptionKey: Buffer | undefined;
  /** WEBHOOK_ALLOW_PRIVATE: http:// URLs and private IP literals are accepted. */
  allowPrivate: boolean;
}

export interface CreatedEndpoint {
  id: string;
  project: string;
  url: string;
  events: WebhookEvent[];
  /** whsec_...: shown this once. */
  secret: string;
}

export interface RotatedSecret {
  endpoint: repository.EndpointListing;
  /** The new whsec_...: shown this once. */
  secret: string;
  /** When the secret it replaced stops signing. */
  previous_secret_expires_at: Date;
}

const MAX_URL_LENGTH = 2048;

/** An endpoint URL, normalised; each delivery checks its scheme again, and names when it connects (address.ts). */
export function endpointUrl(allowPrivate: boolean) {
  return v.pipe(
    v.string(),
    v.trim(),
    v.maxLength(MAX_URL_LENGTH, `The URL is longer than ${MAX_URL_LENGTH} characters.`),
    v.check((text) => URL.canParse(text), 'The URL is not a valid absolute URL.'),
    v.transform((text) => new URL(text)),
    v.check(
      (url) => isAllowedScheme(url, allowPrivate),
      allowPrivate ? 'The URL must be https:// or http://.' : 'The URL must be https:// (http:// only with WEBHOOK_ALLOW_PRIVATE=true).',
    ),
    v.check((url) => url.username === '' && url.password === '', 'The URL may not hold a user name or password.'),
    v.check(
      (url) => allowPrivate || !isForbiddenAddress(ipLiteralOf(url) ?? ''),
      "The URL's host is not a public address (loopback, private, link-local or otherwise special-purpose); those are refused unless WEBHOOK_ALLOW_PRIVATE=true.",
    ),
    v.transform((url) => url.href),
  );
}

const Events = v.pipe(
  v.array(v.picklist(WEBHOOK_EVENTS, `Events are ${WEBHOOK_EVENTS.join(', ')}.`)),
  v.minLength(1, 'Name at least one event.'),
  v.transform((events) => WEBHOOK_EVENTS.filter((event) => events.includes(event))),
);

export async function addEndpoint(
  db: Db,
  settings: WebhookSettings,
  input: { project: string; url: string; events?: readonly string[] },
): Promise<CreatedEndpoint> {
  const project = v.parse(ProjectName, input.project);
  const url = v.parse(endpointUrl(settings.allowPrivate), input.url);
  const events = v.parse(Events, input.events ?? WEBHOOK_EVENTS);
  if (!settings.encryptionKey) throw new MissingEncryptionKeyError();
  const id = newWebhookEndpointId();
  const secret = newWebhookSecret();
  const secretCiphertext = encryptSecret(secret, id, settings.encryptionKey);
  await db.transaction().execute(async (tx) => {
    const projectId = await ensureProject(tx, project);
    await repository.insertEndpoint(tx, { id, project_id: projectId, url, events, secret_ciphertext: secretCiphertext });
  });
  return { id, project, url, events, secret };
}

export const listEndpoints = (db: Db, project?: string) => repository.listEndpoints(db, project);

/** Removes the endpoint and its messages; undefined when there is no endpoint with that id. */
export const removeEndpoint = (db: Db, id: string) => repository.deleteEndpoint(db, id);

/** A new secret for the endpoint; undefined when there is no endpoint with that id. */
export async function rotateSecret(db: Db, encryptionKey: Buffer | undefined, id: string): Promise<RotatedSecret | undefined> {
  if (!encryptionKey) throw new MissingEncryptionKeyError();
  const secret = newWebhookSecret();
  const endpoint = await repository.rotateEndpointSecret(db, id, encryptSecret(secret, id, encryptionKey), SECRET_OVERLAP_MS);
  if (!endpoint) return undefined;
  return { endpoint, secret, previous_secret_expires_at: endpoint.previous_secret_expires_at! };
}
