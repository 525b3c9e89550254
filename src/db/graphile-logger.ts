// graphile-worker logs through our pino logger. Its per-job "completed task" lines are
// debug-level here: at thousands of jobs a second they would drown everything else. So is its
// advice to size the pool like the concurrency: our tasks hold no connection while they wait
// for the upstream, which is where their time goes.
import { Logger as GraphileLogger, type LogLevel } from 'graphile-worker';
import type { Logger } from '../logger.ts';

export function graphileLogger(logger: Logger): GraphileLogger {
  const log = logger.child({ component: 'graphile-worker' });
  return new GraphileLogger((scope) => (level: LogLevel, message: string) => {
    const fields = { workerId: scope.workerId, jobId: scope.jobId, task: scope.taskIdentifier };
    switch (level) {
      case 'error':
        return log.error(fields, message);
      case 'warning':
        if (message.includes('smaller than concurrency')) return log.debug(fields, message);
        return log.warn(fields, message);
      case 'info':
        return log.debug(fields, message);
      default:
        return log.trace(fields, message);
    }
  });
}
