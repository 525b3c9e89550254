// Where webhooks may go: the addresses refused without WEBHOOK_ALLOW_PRIVATE, and the URLs
// accepted when an endpoint is added.
import t from 'tap';
import * as v from 'valibot';
import { isForbiddenAddress } from '../../src/webhooks/address.ts';
import { endpointUrl } from '../../src/webhooks/endpoints.ts';

t.test('only global unicast addresses are allowed, IPv6 forms that carry an IPv4 address judged by it', async (t) => {
  const forbidden = [
    '127.0.0.1', '127.255.255.254', // loopback
    '10.0.0.1', '10.255.255.255', '172.16.0.1', '172.31.255.255', '192.168.0.1', '192.168.255.255', // RFC 1918
    '169.254.0.1', '169.254.169.254', // link-local, cloud metadata
    '0.0.0.0', '0.1.2.3', // unspecified, "this network"
    '100.64.0.1', '100.100.100.200', '100.127.255.255', // shared address space (Alibaba Cloud's metadata service)
    '192.0.0.1', '192.0.0.255', // IETF protocol assignments
    '192.0.2.1', '198.51.100.7', '203.0.113.200', // documentation
    '198.18.0.1', '198.19.255.255', // benchmarking
    '192.88.99.1', // 6to4 relay anycast
    '224.0.0.1', '239.255.255.250', // multicast
    '240.0.0.1', '255.255.255.254', '255.255.255.255', // reserved, broadcast
    '::1', '::', '0:0:0:0:0:0:0:1', // loopback, unspecified
    'fc00::1', 'fd12:3456:789a::1', // unique local
    'fe80::1', 'febf::1', 'fe80::1%eth0', // link-local
    'fec0::1', 'feff::1', // site-local (deprecated)
    'ff02::1', 'ff0e::1', // multicast
    '100::1', // discard
    '::ffff:127.0.0.1', '::ffff:10.1.2.3', '::ffff:169.254.169.254', '::ffff:0.0.0.0', '::ffff:7f00:1', '::ffff:100.64.0.1', // IPv4-mapped
    '::127.0.0.1', '::a00:1', // IPv4-compatible (deprecated)
    '64:ff9b::a00:1', '64:ff9b::7f00:1', '64:ff9b::169.254.169.254', '64:ff9b::6440:1', // NAT64 to forbidden IPv4
    '64:ff9b:1::808:808', '64:ff9b:1:ffff::1', // local-use NAT64: never global
    '2002:0a00:0001::', '2002:7f00:1::1', '2002:a9fe:a9fe::1', '2002:c0a8:101::', // 6to4 of forbidden IPv4
    '2001::1', '2001:0:4136:e378::1', '2001:2::1', '2001:10::1', // IETF assignments: Teredo, benchmarking, ORCHID
    '2001:db8::1', '3fff::1', // documentation
  ];
  const allowed = [
    '8.8.8.8', '1.1.1.1', '172.15.255.255', '172.32.0.1', '192.169.0.1', '169.255.0.1', '11.0.0.1', '126.255.255.255', '128.0.0.1',
    '100.63.255.255', '100.128.0.1', '192.0.1.1', '198.17.255.255', '198.20.0.1', '223.255.255.255',
    '2001:4860:4860::8888', '2606:4700::1111', '2a00:1450:4001::1', '::ffff:8.8.8.8', '::8.8.8.8',
    '64:ff9b::808:808', '64:ff9b::8.8.8.8', // NAT64 to 8.8.8.8
    '2002:0808:0808::', '2002:808:808::1', // 6to4 of 8.8.8.8
  ];
  for (const address of forbidden) t.ok(isForbiddenAddress(address), `${address} is refused`);
  for (const address of allowed) t.notOk(isForbiddenAddress(address), `${address} is allowed`);
  t.notOk(isForbiddenAddress('localhost'), 'a name is not an address: it is checked once resolved');
});

t.test('an endpoint URL: https, no credentials, no IP literal but a public one, unless WEBHOOK_ALLOW_PRIVATE', async (t) => {
  const strict = (url: string) => v.safeParse(endpointUrl(false), url);
  const relaxed = (url: string) => v.safeParse(endpointUrl(true), url);
  t.same(strict('https://hooks.example.com/gateway?x=1').output, 'https://hooks.example.com/gateway?x=1');
  t.same(strict('  https://Hooks.Example.com  ').output, 'https://hooks.example.com/', 'trimmed and normalised');
  t.ok(strict('https://localhost:8443/hooks').success, 'a name passes: it is checked when a delivery connects');
  t.ok(strict('https://8.8.8.8/hooks').success, 'a public IP literal passes');
  t.ok(strict('https://[64:ff9b::808:808]/hooks').success, 'and so does a NAT64 address of one');

  const refusals: [string, RegExp][] = [
    ['http://hooks.example.com/', /must be https/],
    ['ftp://hooks.example.com/', /must be https/],
    ['not a url', /not a valid absolute URL/],
    ['https://user:secret@hooks.example.com/', /user name or password/],
    ['https://127.0.0.1/hooks', /not a public address/],
    ['https://10.0.0.8/hooks', /not a public address/],
    ['https://169.254.169.254/latest/meta-data', /not a public address/],
    ['https://[::1]:8443/hooks', /not a public address/],
    ['https://[::ffff:127.0.0.1]/hooks', /not a public address/],
    ['https://[fd00::1]/hooks', /not a public address/],
    ['https://100.100.100.200/latest/meta-data', /not a public address/],
    ['https://[64:ff9b::a9fe:a9fe]/', /not a public address/],
    ['https://[2002:a00:1::]/', /not a public address/],
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
