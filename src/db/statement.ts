// A statement on every request's path, built once. kysely builds a raw statement anew each time
// it runs: its template's fragments assembled into a tree, the tree walked by the schema plugin
// and compiled to text, and that new text then hashed whole to find its prepared statement
// (pool.ts). For a statement of a few kilobytes that is tens of microseconds of the process's
// CPU per run. A Statement builds its text once, on its first run, with a numbered placeholder
// ($1, $2, ...) in place of each named value, and each run binds only the values.
import { CompiledQuery, sql, type QueryResult, type RawBuilder } from 'kysely';
import type { Db } from './pool.ts';

/**
 * A statement whose values are `names`: `build` writes it with `values.<name>` where each value
 * goes, and anything else in it must be fixed text (constants as `sql.lit`), since the text is
 * built once for every run.
 */
export function statement<const Names extends readonly string[], Row>(
  names: Names,
  build: (values: Record<Names[number], RawBuilder<unknown>>) => RawBuilder<Row>,
): Statement<Row, Names[number]> {
  return new Statement(names, build);
}

export class Statement<Row, Name extends string> {
  readonly #names: readonly Name[];
  readonly #build: (values: Record<Name, RawBuilder<unknown>>) => RawBuilder<Row>;
  #text: string | undefined;

  constructor(names: readonly Name[], build: (values: Record<Name, RawBuilder<unknown>>) => RawBuilder<Row>) {
    this.#names = names;
    this.#build = build;
  }

  async execute(db: Db, values: Record<Name, unknown>): Promise<QueryResult<Row>> {
    this.#text ??= this.#compile(db);
    return db.executeQuery(CompiledQuery.raw(this.#text, this.#names.map((name) => values[name])) as CompiledQuery<Row>);
  }

  #compile(db: Db): string {
    const placeholders = Object.fromEntries(this.#names.map((name, index) => [name, sql.raw(`$${index + 1}`)]));
    const compiled = this.#build(placeholders as Record<Name, RawBuilder<unknown>>).compile(db);
    // kysely numbers a value written into the template from $1 as well: it would take a
    // placeholder's place.
    if (compiled.parameters.length > 0) {
      throw new Error(`a Statement's values must be named placeholders; its template holds ${compiled.parameters.length} other values`);
    }
    return compiled.sql;
  }
}

/**
 * A statement's input column: its name, its SQL type, and where an item of a group has its value.
 * A group goes as one array per column (`columnArrays`), unnested into rows (`unnestRows`).
 */
export type InputColumn<Item, Name extends string = string> = readonly [name: Name, type: string, pick: (item: Item) => unknown];

/** The values of a group's columns: one array per column, in the items' order. */
export function columnArrays<Item, Name extends string>(columns: readonly InputColumn<Item, Name>[], items: readonly Item[]): Record<Name, unknown[]> {
  return Object.fromEntries(columns.map(([name, , pick]) => [name, items.map((item) => pick(item))])) as Record<Name, unknown[]>;
}

/**
 * The rows of a group, from the arrays of its columns (each the named value of its column, cast
 * to an array of its type): `select * from unnest(...) with ordinality as t(<names>, ord)`, ord
 * being each item's position.
 */
export function unnestRows<Name extends string>(
  columns: readonly InputColumn<never, Name>[],
  values: Record<Name, RawBuilder<unknown>>,
): RawBuilder<unknown> {
  return sql`select * from unnest(${sql.join(columns.map(([name, type]) => sql`${values[name]}::${sql.raw(type)}[]`))})
      with ordinality as t(${sql.join(columns.map(([name]) => sql.id(name)))}, ord)`;
}
