// Where webhooks may go: the addresses refused without WEBHOOK_ALLOW_PRIVATE, and the URLs
// accepted when an endpoint is added.
import t from 'tap';
import * as v from 'valibot';
import { isForbiddenAddress } from '../../src/webhooks/address.ts';
import { endpointUrl } from '../../src/webhooks/endpoints.ts';

t.test('loopback, private, link-local and unspecified addresses are refused, in IPv4, IPv6 and IPv4-mapped forms', async (t) => {
  const forbidden = [
    '127.0.0.1', '127.255.255.254', // loopback
    '10.0.0.1', '10.255.255.255', '172.16.0.1', '172.31.255.255', '192.168.0.1', '192.168.255.255', // RFC 1918
    '169.254.0.1', '169.254.169.254', // link-local, cloud metadata
    '0.0.0.0', '0.1.2.3', // unspecified, "this network"
    '::1', '::', '0:0:0:0:0:0:0:1', // loopback, unspecified
    'fc00::1', 'fd12:3456:789a::1', // unique local
    'fe80::1', 'febf::1', // link-local
    '::ffff:127.0.0.1', '::ffff:10.1.2.3', '::ffff:169.254.169.254', '::ffff:0.0.0.0', '::ffff:7f00:1', // IPv4-mapped
    '::127.0.0.1', // IPv4-compatible (deprecated)
  ];
  const allowed = [
    '8.8.8.8', '1.1.1.1', '172.15.255.255', '172.32.0.1', '192.169.0.1', '169.255.0.1', '11.0.0.1', '126.255.255.255', '128.0.0.1',
    '2001:4860:4860::8888', '2606:4700::1111', 'fec0::1', '::ffff:8.8.8.8',
  ];
  for (const address of forbidden) t.ok(isForbiddenAddress(address), `${address} is refused`);
  for (const address of allowed) t.notOk(isForbiddenAddress(address), `${address} is allowed`);
  t.notOk(isForbiddenAddress('localhost'), 'a name is not an address: it is checked once resolved');
});

t.test('an endpoint URL: https, no credentials, no private IP literal, unless WEBHOOK_ALLOW_PRIVATE', async (t) => {
  const strict = (url: string) => v.safeParse(endpointUrl(false), url);
  const relaxed = (url: string) => v.safeParse(endpointUrl(true), url);
  t.same(strict('https://hooks.example.com/gateway?x=1').output, 'https://hooks.example.com/gateway?x=1');
  t.same(strict('  https://Hooks.Example.com  ').output, 'https://hooks.example.com/', 'trimmed and normalised');
  t.ok(strict('https://localhost:8443/hooks').success, 'a name passes: it is checked when a delivery connects');
  t.ok(strict('https://8.8.8.8/hooks').success, 'a public IP literal passes');

  const refusals: [string, RegExp][] = [
    ['http://hooks.example.com/', /must be https/],
    ['ftp://hooks.example.com/', /must be https/],
    ['not a url', /not a valid absolute URL/],
    ['https://user:secret@hooks.example.com/', /user name or password/],
    ['https://127.0.0.1/hooks', /loopback, private or link-local/],
    ['https://10.0.0.8/hooks', /loopback, private or link-local/],
    ['https://169.254.169.254/latest/meta-data', /loopback, private or link-local/],
    ['https://[::1]:8443/hooks', /loopback, private or link-local/],
    ['https://[::ffff:127.0.0.1]/hooks', /loopback, private or link-local/],
    ['https://[fd00::1]/hooks', /loopback, private or link-local/],
    [`https://example.com/${'x'.repeat(2048)}`, /longer than 2048/],
  ];
  for (const [url, message] of refusals) {
    const result = strict(url);
    t.notOk(result.success, `${url.slice(0, 60)} is refused`);
    t.match(result.issues?.[0]?.message, message);
  }
  t.ok(relaxed('http://127.0.0.1:9000/hooks').success, 'WEBHOOK_ALLOW_PRIVATE=true: http and loopback are accepted');
  t.ok(relaxed('http://[::1]:9000/hooks').success);
  t.notOk(relaxed('ftp://127.0.0.1/').success, 'but only http and https');
});
