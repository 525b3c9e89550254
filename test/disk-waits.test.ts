// The disk-wait figures the benchmark and the noisy-neighbour scenario print (scripts/disk-waits.ts).
import t from 'tap';
import { DiskWaitTally, formatDiskWaits, processesWaitingOnDisk } from '../scripts/disk-waits.ts';

t.test('a run of looks that found a process waiting counts from its first look to the first look after it that found none', async (t) => {
  const tally = new DiskWaitTally();
  const looks = [0, 0, 1, 2, 1, 0, 0, 1, 0, 1, 1];
  looks.forEach((waiting, i) => tally.add(i * 20, waiting));
  t.same(tally.figures(), { looks: 11, waiting: 6, longestMs: 60 }, 'the run at 40-80 ms ended by the look at 100 ms');
  tally.close(260);
  t.same(tally.figures(), { looks: 11, waiting: 6, longestMs: 80 }, 'a run still open when the window ends counts up to its end');
  tally.close(400);
  t.equal(tally.figures().longestMs, 80, 'closing twice changes nothing');
  t.equal(formatDiskWaits(tally.figures()), 'the disk: a process of the machine waited on it in 6 of 11 looks (20 ms apart), at most 80 ms in a row');
});

t.test('the machine is looked at through /proc/stat', { skip: process.platform !== 'linux' && 'not Linux' }, async (t) => {
  const waiting = processesWaitingOnDisk();
  t.ok(Number.isInteger(waiting) && waiting! >= 0, `a count of processes (${waiting})`);
});
