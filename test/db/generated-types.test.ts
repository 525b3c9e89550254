// The row types kysely sees are the schema's: src/db/schema.generated.ts is what kysely-codegen
// generates from a database migrated from sql/ (a clone of the tests' template), byte for byte.
import { readFile } from 'node:fs/promises';
import t from 'tap';
import { GENERATED_FILE, generateSchemaTypes, REGENERATE_COMMAND } from '../../scripts/db-types.ts';
import { createTestDatabase } from '../helpers/database.ts';

t.test('src/db/schema.generated.ts is what kysely-codegen generates from the migrated schema', async (t) => {
  const generated = await generateSchemaTypes(await createTestDatabase(t));
  const checkedIn = await readFile(GENERATED_FILE, 'utf8');
  t.ok(generated.includes('export interface Requests {'), 'the generation sees the gateway tables');
  t.equal(checkedIn, generated, `src/db/schema.generated.ts is up to date with sql/ (when it is not, \`${REGENERATE_COMMAND}\` regenerates it)`);
});
