// Where webhooks may go. An endpoint URL is a project's choice, and a delivery is a request made
// from inside our network: pointed at 127.0.0.1, 10.0.0.5 or 169.254.169.254, it would reach
// the database, an admin port or a cloud metadata service. Unless WEBHOOK_ALLOW_PRIVATE is on,
// deliveries reach only public addresses, checked where it counts: each address a name resolves
// to before connecting, and the address actually connected to (so neither an IP literal nor a
// name that resolves differently the second time gets through).
import { lookup as dnsLookup, type LookupAddress, type LookupAllOptions } from 'node:dns';
import { BlockList, isIP, type LookupFunction, type Socket } from 'node:net';
import { buildConnector } from 'undici';

const FORBIDDEN = new BlockList();
FORBIDDEN.addSubnet('0.0.0.0', 8, 'ipv4'); // "this network": 0.0.0.0 connects to the host itself
FORBIDDEN.addSubnet('10.0.0.0', 8, 'ipv4'); // RFC 1918
FORBIDDEN.addSubnet('127.0.0.0', 8, 'ipv4'); // loopback
FORBIDDEN.addSubnet('169.254.0.0', 16, 'ipv4'); // link-local, where cloud metadata services answer
FORBIDDEN.addSubnet('172.16.0.0', 12, 'ipv4'); // RFC 1918
FORBIDDEN.addSubnet('192.168.0.0', 16, 'ipv4'); // RFC 1918
// :: (unspecified), ::1 (loopback) and the deprecated IPv4-compatible ::a.b.c.d. IPv4-mapped
// addresses (::ffff:a.b.c.d) are checked against the IPv4 rules by BlockList itself.
FORBIDDEN.addSubnet('::', 96, 'ipv6');
FORBIDDEN.addSubnet('fc00::', 7, 'ipv6'); // unique local
FORBIDDEN.addSubnet('fe80::', 10, 'ipv6'); // link-local

/** Whether deliveries may not go to this IP address (loopback, private, link-local, unspecified). */
export function isForbiddenAddress(address: string): boolean {
  const family = isIP(address);
  if (family === 0) return false;
  return FORBIDDEN.check(address, family === 6 ? 'ipv6' : 'ipv4');
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
 * undici's connector for deliveries. Without allowPrivate, names resolve to public addresses
 * only, and a socket connected to a forbidden address anyway (an IP literal, which is never
 * looked up) is destroyed before a byte is written.
 */
export function deliveryConnector(options: { allowPrivate: boolean; timeoutMs: number }): buildConnector.connector {
  // Deliveries are one POST each: HTTP/1.1, as receivers expect.
  const base = buildConnector({ timeout: options.timeoutMs, allowH2: false, ...(options.allowPrivate ? {} : { lookup: publicLookup }) });
  if (options.allowPrivate) return base;
  return (connectOptions, callback) => {
    base(connectOptions, (error, socket) => {
      if (error) return callback(error, null);
      const address = (socket as Socket).remoteAddress;
      if (address === undefined || isForbiddenAddress(address)) {
        socket.destroy();
        return callback(new ForbiddenAddressError(address ?? connectOptions.hostname), null);
      }
      callback(null, socket);
    });
  };
}
