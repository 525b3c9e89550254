// The benchmark's CPU accounting (bench/cpu.ts): which Postgres backends are the phase's, and
// which serve another database and so count as "other".
import net from 'node:net';
import { readFileSync } from 'node:fs';
import { setTimeout as sleep } from 'node:timers/promises';
import pg from 'pg';
import t from 'tap';
import { CpuMeter } from '../../bench/cpu.ts';
import { adminQuery, createTestDatabase } from '../helpers/database.ts';

function parentPid(pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, 'latin1');
  return Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
}

t.test(
  'a backend first seen before its startup message, then busy for another database, counts as other, not as Postgres',
  { skip: process.platform !== 'linux' && 'reads /proc' },
  async (t) => {
    const url = await createTestDatabase(t);
    const database = new URL(url).pathname.slice(1);
    const postmasterPid = await adminQuery(url, async (client) => {
      const { rows } = await client.query<{ pid: number }>('select pg_backend_pid() as pid');
      try {
        return parentPid(rows[0]!.pid);
      } catch {
        return undefined; // the server is not on this machine
      }
    });
    if (postmasterPid === undefined) {
      t.plan(0, 'the Postgres server is not on this machine');
      return;
    }

    // A connection whose backend has been forked but has not read its startup message yet: its
    // process title is still the postmaster's command line.
    const target = new URL(url);
    const socket = net.connect({ host: target.hostname, port: Number(target.port || 5432) });
    await new Promise((resolve, reject) => socket.once('connect', resolve).once('error', reject));
    t.teardown(() => void socket.destroy());
    CpuMeter.prepare();
    await sleep(300);
    const meter = new CpuMeter({ gatewayPids: () => [], postmasterPid, database: () => 'not_the_busy_database' });
    // The window's first reading, and one more, see it so.
    await sleep(800);

    // Now it starts, for the test's database, and keeps a core busy.
    socket.connect = (() => {
      process.nextTick(() => socket.emit('connect'));
      return socket;
    }) as typeof socket.connect;
    const client = new pg.Client({ connectionString: url, stream: () => socket });
    await client.connect();
    t.teardown(() => client.end());
    await client.query('select count(*) from generate_series(1, 4000000)');
    const shares = await meter.end();

    const busy = shares.others.find((other) => other.name === `postgres (database ${database})`);
    t.ok(busy && busy.cores > 0.2, `the backend of ${database} is among the busiest others: ${JSON.stringify(shares.others)}; postgres ${shares.cores.postgres.toFixed(2)} cores`);
  },
);
