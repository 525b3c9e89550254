// JSON logs on stdout (pino). What is logged is chosen field by field at each call site:
// ids, statuses, codes and timings, never keys, signing secrets, headers or message content.
// The redaction list is a second line of defence for anything that slips through.
import { pino, type Logger } from 'pino';
import type { Config } from './config.ts';

export type { Logger };

export function createLogger(
  config: Pick<Config, 'logLevel'>,
  destination?: pino.DestinationStream,
): Logger {
  return pino(
    {
      level: config.logLevel,
      base: { service: 'gateway', pid: process.pid },
      timestamp: pino.stdTimeFunctions.isoTime,
      formatters: { level: (label) => ({ level: label }) },
      redact: {
        paths: [
          'authorization',
          'headers.authorization',
          'headers["svc-signature"]',
          '*.authorization',
          'apiKey',
          'api_key',
          'signingSecret',
          'signing_secret',
          'upstreamApiKey',
        ],
        censor: '[redacted]',
      },
    },
    destination ?? pino.destination({ dest: 1, sync: true }),
  );
}
