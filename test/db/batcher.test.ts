// The Batcher on its own (no database): groups bounded by count and by bytes, results that come
// later than their group's, and one bad item not failing its neighbours.
import t from 'tap';
import { Batcher } from '../../src/db/batcher.ts';

const MiB = 1024 * 1024;

/** A write that records each group's items and holds it until released, so that the next ones queue. */
function recordingWrite<Item>() {
  const groups: Item[][] = [];
  let release: () => void = () => {};
  let held = new Promise<void>((resolve) => (release = resolve));
  return {
    groups,
    release: () => {
      release();
      held = new Promise<void>((resolve) => (release = resolve));
    },
    write: async (items: Item[]) => {
      groups.push(items);
      if (groups.length === 1) await held;
      return items.map(() => true);
    },
  };
}

t.test('groups are cut by bytes: none passes the budget, an item heavier than it goes alone', async (t) => {
  const { groups, release, write } = recordingWrite<{ name: string; bytes: number }>();
  const batcher = new Batcher(write, { maxInFlight: 1, maxBatch: 500, maxBytes: { max: 16 * MiB, sizeOf: (item) => item.bytes } });
  const first = batcher.submit({ name: 'first', bytes: 1 });
  // Queued behind the first group: 40 items of 3 MiB, one of 20 MiB, 10 more of 3 MiB.
  const items = [
    ...Array.from({ length: 40 }, (_, i) => ({ name: `a${i}`, bytes: 3 * MiB })),
    { name: 'huge', bytes: 20 * MiB },
    ...Array.from({ length: 10 }, (_, i) => ({ name: `b${i}`, bytes: 3 * MiB })),
  ];
  const rest = items.map((item) => batcher.submit(item));
  release();
  await Promise.all([first, ...rest]);
  const sizes = groups.slice(1).map((group) => group.reduce((sum, item) => sum + item.bytes, 0));
  t.ok(sizes.every((bytes, i) => bytes <= 16 * MiB || groups[i + 1]!.length === 1), `group bytes: ${sizes.map((b) => (b / MiB).toFixed(0)).join(', ')} MiB`);
  t.same(groups.slice(1).map((group) => group.length), [5, 5, 5, 5, 5, 5, 5, 5, 1, 5, 5], '5 of 3 MiB fit in 16 MiB; the 20 MiB one alone');
  t.same(groups.flat().map((item) => item.name), ['first', ...items.map((item) => item.name)], 'in the order submitted');
});

t.test('without a byte budget, groups are cut by count only', async (t) => {
  const { groups, release, write } = recordingWrite<number>();
  const batcher = new Batcher(write, { maxInFlight: 1, maxBatch: 100 });
  const all = [batcher.submit(0), ...Array.from({ length: 250 }, (_, i) => batcher.submit(i + 1))];
  release();
  await Promise.all(all);
  t.same(groups.map((group) => group.length), [1, 100, 100, 50]);
});

t.test("a result may come after its group's statement: the next group does not wait for it", async (t) => {
  let later: (value: string) => void = () => {};
  const batcher = new Batcher<string, string>(
    async (items) => items.map((item) => (item === 'late' ? new Promise<string>((resolve) => (later = resolve)) : `${item}!`)),
    { maxInFlight: 1, maxBatch: 10 },
  );
  const late = batcher.submit('late');
  t.equal(await batcher.submit('next'), 'next!', 'the next group is written while the late result is pending');
  later('late!');
  t.equal(await late, 'late!');
});

t.test('one bad item fails alone: its neighbours are written again one by one', async (t) => {
  const { groups, release, write } = recordingWrite<number>();
  const batcher = new Batcher<number, boolean>(
    async (items) => {
      if (items.includes(13)) throw new Error('bad item');
      return write(items);
    },
    { maxInFlight: 1, maxBatch: 10 },
  );
  const first = batcher.submit(0);
  const settled = Promise.allSettled([12, 13, 14].map((item) => batcher.submit(item)));
  release();
  await first;
  t.same((await settled).map((result) => result.status), ['fulfilled', 'rejected', 'fulfilled']);
  t.same(groups, [[0], [12], [14]], 'the group of three failed; 12 and 14 were then written alone');
});

t.test('the items of a failed group are written alone in its turn: statements under way stay within maxInFlight', async (t) => {
  let underWay = 0;
  let most = 0;
  const batcher = new Batcher<number, number>(
    async (items) => {
      underWay++;
      most = Math.max(most, underWay);
      await new Promise((resolve) => setTimeout(resolve, 5));
      underWay--;
      if (items.length > 1) throw new Error('a bad item among them');
      return items;
    },
    { maxInFlight: 3, maxBatch: 50 },
  );
  const results = await Promise.all(Array.from({ length: 40 }, (_, i) => batcher.submit(i)));
  t.same(results, Array.from({ length: 40 }, (_, i) => i), 'each written alone, with its own result');
  t.ok(most <= 3, `at most 3 statements under way at once (${most})`);
});

t.test('the database unavailable while a failed group is written alone: the rest fail at once, unwritten', async (t) => {
  const written: number[] = [];
  const refused = Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5432'), { code: 'ECONNREFUSED' });
  const batcher = new Batcher<number, number>(
    async (items) => {
      if (items.length > 1) throw new Error('a bad item among them');
      if (items[0] === 2) throw refused;
      written.push(items[0]!);
      return items;
    },
    { maxInFlight: 1, maxBatch: 10 },
  );
  const first = batcher.submit(0);
  const settled = Promise.allSettled([1, 2, 3, 4].map((item) => batcher.submit(item)));
  await first;
  t.same((await settled).map((result) => (result.status === 'rejected' ? (result.reason === refused ? 'unavailable' : 'other') : 'written')), ['written', 'unavailable', 'unavailable', 'unavailable']);
  t.same(written, [0, 1], 'nothing written after the database was found unavailable');
});
