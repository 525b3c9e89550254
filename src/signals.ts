// SIGINT/SIGTERM start an orderly shutdown and exit 0 when it is done; a second signal exits
// at once. An unhandled rejection is logged, not fatal: graphile-worker leaves some of its
// bookkeeping promises unhandled when Postgres goes away, and the supervisor and the sweep
// already recover from what they report; crashing would only cut off every open request.
import { errorSummary } from './db/pool.ts';
import type { Logger } from './logger.ts';

export function stopOnSignals(
  stop: () => Promise<void>,
  logger: Logger,
  signals: NodeJS.Signals[] = ['SIGINT', 'SIGTERM'],
): void {
  let stopping = false;
  const onSignal = (signal: NodeJS.Signals) => {
    if (stopping) {
      logger.warn({ signal }, 'second signal: exiting without finishing the shutdown');
      process.exit(1);
    }
    stopping = true;
    logger.info({ signal }, 'shutting down');
    stop().then(
      () => {
        logger.info('shut down cleanly');
        process.exit(0);
      },
      (error: unknown) => {
        logger.error({ err: { ...errorSummary(error), stack: (error as Error)?.stack } }, 'shutdown failed');
        process.exit(1);
      },
    );
  };
  for (const signal of signals) process.on(signal, onSignal);
  process.on('unhandledRejection', (reason) => {
    logger.error({ err: { ...errorSummary(reason), stack: (reason as Error)?.stack } }, 'unhandled rejection');
  });
}
