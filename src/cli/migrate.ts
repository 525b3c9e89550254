// gateway migrate
import { migrate } from '../db/migrate.ts';
import type { AdminCommand } from '../main.ts';

export const migrateCommand: AdminCommand = async (_db, { pool, logger }) => {
  await migrate(pool, logger);
  return 'The database schema is up to date.';
};
