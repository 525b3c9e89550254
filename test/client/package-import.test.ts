// The client is importable by the package's own name, as users import it.
import t from 'tap';
import * as byName from 'chat-gateway/client';
import * as bySource from '../../src/client/index.ts';

t.test('chat-gateway/client is the client library', async (t) => {
  t.equal(byName.Gateway, bySource.Gateway);
  t.equal(byName.signRequest, bySource.signRequest);
  t.equal(typeof byName.createSigningFetch, 'function');
  t.equal(byName.signWebhook, bySource.signWebhook);
  t.equal(byName.WebhookVerificationError, bySource.WebhookVerificationError);
});
