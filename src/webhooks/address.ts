// Where webhooks may go. An endpoint URL is a project's choice, and a delivery is a request made
// from inside our network: pointed at 127.0.0.1, 10.0.0.5, 169.254.169.254 or 100.100.100.200,
// it would reach the database, an admin port or a cloud metadata service. Unless
// WEBHOOK_ALLOW_PRIVATE is on, deliveries reach global unicast addresses only, an allow-list
// rather than a list of known dangers, checked where it counts: an IP literal before connecting,
// and each address a name resolves to in the lookup the connection makes, so that a forbidden
// address never gets as far as a TCP connection (let alone a TLS handshake), and a name that
// resolves differently the second time gets nowhere either.
import { lookup as dnsLookup, type LookupAddress, type LookupAllOptions } from 'node:dns';
import { BlockList, isIP, type LookupFunction } from 'node:net';
import { buildConnector } from 'undici';

function subnets(type: 'ipv4' | 'ipv6', blocks: [string, number][]): BlockList {
  const list = new BlockList();
  for (const [network, prefix] of blocks) list.addSubnet(network, prefix, type);
  return list;
}

// IPv4 that is not global unicast: the special-purpose blocks (IANA's registry) that are not
// globally reachable, multicast and the reserved rest.
const NOT_GLOBAL_V4 = subnets('ipv4', [
  ['0.0.0.0', 8], // "this network": 0.0.0.0 connects to the host itself
  ['10.0.0.0', 8], // private (RFC 1918)
  ['100.64.0.0', 10], // shared address space (carrier-grade NAT), where Alibaba Cloud's metadata service answers
  ['127.0.0.0', 8], // loopback
  ['169.254.0.0', 16], // link-local, where most cloud metadata services answer
  ['172.16.0.0', 12], // private
  ['192.0.0.0', 24], // IETF protocol assignments
  ['192.0.2.0', 24], // documentation
  ['192.88.99.0', 24], // 6to4 relay anycast (deprecated)
  ['192.168.0.0', 16], // private
  ['198.18.0.0', 15], // benchmarking
  ['198.51.100.0', 24], // documentation
  ['203.0.113.0', 24], // documentation
  ['224.0.0.0', 4], // multicast
  ['240.0.0.0', 4], // reserved, and 255.255.255.255, broadcast
]);
// IPv6 global unicast is 2000::/3: outside it are ::1, ::, link-local, site-local (fec0::/10),
// unique local, multicast, the local-use NAT64 prefix 64:ff9b:1::/48 and the rest.
const GLOBAL_V6 = subnets('ipv6', [['2000::', 3]]);
// Inside 2000::/3, what is not globally reachable.
const NOT_GLOBAL_V6 = subnets('ipv6', [
  ['2001::', 23], // IETF protocol assignments: Teredo, benchmarking, ORCHID...
  ['2001:db8::', 32], // documentation
  ['3fff::', 20], // documentation
]);

/**
 * Whether the IP address is global unicast: one deliveries may go to. An IPv6 address that
 * carries an IPv4 address (IPv4-mapped ::ffff:a.b.c.d, IPv4-compatible ::a.b.c.d, NAT64
 * 64:ff9b::/96, 6to4 2002::/16) is judged by that IPv4 address, where it leads. A name is not.
 */
export function isGlobalUnicast(address: string): boolean {
  switch (isIP(address)) {
    case 4:
      return !NOT_GLOBAL_V4.check(address, 'ipv4');
    case 6: {
      // A zone (fe80::1%eth0) is only ever needed by a link-local address.
      if (address.includes('%')) return false;
      const ipv4 = embeddedIpv4(groupsOf(address));
      if (ipv4 !== undefined) return isGlobalUnicast(ipv4);
      return GLOBAL_V6.check(address, 'ipv6') && !NOT_GLOBAL_V6.check(address, 'ipv6');
    }
    default:
      return false;
  }
}

/** Whether deliveries may not go to this IP address: any but global unicast. False for a name. */
export function isForbiddenAddress(address: string): boolean {
  return isIP(address) !== 0 && !isGlobalUnicast(address);
}

/** The eight 16-bit groups of a valid IPv6 address without a zone. */
function groupsOf(address: string): number[] {
  // A trailing dotted quad (::ffff:10.0.0.1) is the last two groups.
  const text = address.replace(/(\d+)\.(\d+)\.(\d+)\.(\d+)$/, (_, a: string, b: string, c: string, d: string) =>
    `${((Number(a) << 8) | Number(b)).toString(16)}:${((Number(c) << 8) | Number(d)).toString(16)}`,
  );
  const [head = '', tail] = text.split('::');
  const parse = (part: string) => (part === '' ? [] : part.split(':').map((group) => Number.parseInt(group, 16)));
  const front = parse(head);
  const back = tail === undefined ? [] : parse(tail);
  return [...front, ...new Array<number>(8 - front.length - back.length).fill(0), ...back];
}

/** The IPv4 address an IPv6 address carries, in the forms that lead to it; undefined for others. */
function embeddedIpv4(groups: number[]): string | undefined {
  const [g0, g1, g2, , , g5, g6, g7] = groups as [number, number, number, number, number, number, number, number];
  const quad = (high: number, low: number) => `${high >> 8}.${high & 0xff}.${low >> 8}.${low & 0xff}`;
  const zeros = (from: number, to: number) => groups.slice(from, to).every((group) => group === 0);
  // IPv4-compatible ::a.b.c.d (:: and ::1 among them), IPv4-mapped ::ffff:a.b.c.d.
  if (zeros(0, 5) && (g5 === 0 || g5 === 0xffff)) return quad(g6, g7);
  // NAT64's well-known prefix: the translator connects to the IPv4 address.
  if (g0 === 0x64 && g1 === 0xff9b && zeros(2, 6)) return quad(g6, g7);
  // 6to4: the IPv4 address of the tunnel's end.
  if (g0 === 0x2002) return quad(g1, g2);
  return undefined;
}

/** Whether deliveries may use the URL's scheme: https, and http too with WEBHOOK_ALLOW_PRIVATE. */
export function isAllowedScheme(url: URL, allowPrivate: boolean): boolean {
  return url.protocol === 'https:' || (allowPrivate && url.protocol === 'http:');
}

/** A delivery refused because of where the endpoint is: a failed try, retried like any other. */
export class ForbiddenAddressError extends Error {
  override name = 'ForbiddenAddressError';
  readonly code = 'EWEBHOOKPRIVATE';
  readonly address: string;
  constructor(address: string) {
    super(`the endpoint resolves to a private address (${address}); WEBHOOK_ALLOW_PRIVATE is off`);
    this.address = address;
  }
}

/** The host of a URL as an IP address when it is one (IPv6 without its brackets), else undefined. */
export function ipLiteralOf(url: URL): string | undefined {
  const host = url.hostname.replace(/^\[(.*)\]$/, '$1');
  return isIP(host) === 0 ? undefined : host;
}

/**
 * dns.lookup for net.connect that leaves out forbidden addresses, and fails with
 * ForbiddenAddressError when the name resolves to nothing else.
 */
const publicLookup: LookupFunction = (hostname, options, callback) => {
  const all: LookupAllOptions = { all: true };
  if (options.family === 4 || options.family === 6) all.family = options.family;
  dnsLookup(hostname, all, (error, addresses: LookupAddress[]) => {
    if (error) return callback(error, []);
    const allowed = addresses.filter((entry) => !isForbiddenAddress(entry.address));
    if (allowed.length === 0) {
      return callback(new ForbiddenAddressError(addresses[0]?.address ?? hostname) as NodeJS.ErrnoException, []);
    }
    if (options.all) return callback(null, allowed);
    callback(null, allowed[0]!.address, allowed[0]!.family);
  });
};

/**
 * undici's connector for deliveries. Without allowPrivate, an IP literal (which is never looked
 * up) is refused before connecting, and names resolve to global unicast addresses only.
 */
export function deliveryConnector(options: { allowPrivate: boolean; timeoutMs: number }): buildConnector.connector {
  // Deliveries are one POST each: HTTP/1.1, as receivers expect.
  const base = buildConnector({ timeout: options.timeoutMs, allowH2: false, ...(options.allowPrivate ? {} : { lookup: publicLookup }) });
  if (options.allowPrivate) return base;
  return (connectOptions, callback) => {
    if (isForbiddenAddress(connectOptions.hostname)) return callback(new ForbiddenAddressError(connectOptions.hostname), null);
    base(connectOptions, callback);
  };
}
