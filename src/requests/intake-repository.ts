// SQL of the intake limits (requests/intake.ts), run by API processes in the background, never
// on a request's path: each process's admissions per key in gateway.intake_counters, and the
// unfinished requests of the projects it sees.
import { sql } from 'kysely';
import type { IntakeKind } from '../db/database.ts';
import type { Db } from '../db/pool.ts';
import type { KeyMode } from '../ids.ts';

export type { IntakeKind };

export interface AdmittedCount {
  apiKeyId: string;
  kind: IntakeKind;
  /** Admitted by this process since its last report (0: nothing to add): requests, or bytes. */
  admitted: number;
}

/**
 * Adds this process's new admissions to its counters, and returns, for each count given (in
 * order), the sum of the other processes' counters for that key and kind. Increments rather
 * than totals, so that a process that forgets an idle key and meets it again carries on from
 * its row instead of starting it again from zero (which the others would read as a drop).
 * Counters of a key deleted meanwhile are skipped.
 */
export async function addAdmittedAndReadOthers(
  db: Db,
  processId: string,
  counts: readonly AdmittedCount[],
): Promise<number[]> {
  const keyIds = counts.map((count) => count.apiKeyId);
  const kinds = counts.map((count) => count.kind);
  const admitted = counts.map((count) => count.admitted);
  const { rows } = await sql<{ others: string }>`
    with reported as (
      insert into gateway.intake_counters as counters (api_key_id, kind, process_id, admitted)
      select added.api_key_id, added.kind, ${processId}, added.admitted
      from unnest(${keyIds}::text[], ${kinds}::text[], ${admitted}::bigint[]) as added(api_key_id, kind, admitted)
      join gateway.api_keys on api_keys.id = added.api_key_id
      where added.admitted > 0
      on conflict (api_key_id, kind, process_id)
      do update set admitted = counters.admitted + excluded.admitted, updated_at = now()
    )
    select coalesce(sum(counters.admitted), 0) as others
    from unnest(${keyIds}::text[], ${kinds}::text[]) with ordinality as tracked(api_key_id, kind, position)
    left join gateway.intake_counters as counters
      on counters.api_key_id = tracked.api_key_id and counters.kind = tracked.kind
      and counters.process_id <> ${processId}
    group by tracked.position
    order by tracked.position
  `.execute(db);
  return rows.map((row) => Number(row.others));
}

/**
 * Deletes the counters no process has added to for `olderThanMs`: those of processes gone, and
 * of keys a process has stopped using. Rows being updated right now are skipped, not waited for.
 */
export async function deleteStaleIntakeCounters(db: Db, olderThanMs: number): Promise<void> {
  await sql`
    delete from gateway.intake_counters
    where (api_key_id, kind, process_id) in (
      select api_key_id, kind, process_id from gateway.intake_counters
      where updated_at < now() - ${olderThanMs}::float8 * interval '1 millisecond'
      for update skip locked
    )
  `.execute(db);
}

/** Deletes the counters of one process (it is stopping). */
export async function deleteIntakeCounters(db: Db, processId: string): Promise<void> {
  await db.deleteFrom('intake_counters').where('process_id', '=', processId).execute();
}

export interface ProjectMode {
  projectId: string;
  mode: KeyMode;
}

/**
 * For each project and mode given (in order), its requests not finished yet, counted up to
 * `atMost`: a project far over its limit costs no more to count than one just over it.
 */
export async function countUnfinished(db: Db, projects: readonly ProjectMode[], atMost: number): Promise<number[]> {
  const projectIds = projects.map((project) => project.projectId);
  const modes = projects.map((project) => project.mode);
  const { rows } = await sql<{ unfinished: string }>`
    select counted.unfinished
    from unnest(${projectIds}::bigint[], ${modes}::text[]) with ordinality as wanted(project_id, mode, position)
    cross join lateral (
      select count(*) as unfinished
      from (
        select from gateway.requests
        where requests.project_id = wanted.project_id and requests.mode = wanted.mode
          and requests.finished_at is null
        limit ${atMost}
      ) as unfinished_requests
    ) as counted
    order by wanted.position
  `.execute(db);
  return rows.map((row) => Number(row.unfinished));
}

/** Which of the requests `ids` are stored (in any status). */
export async function storedRequests(db: Db, ids: readonly string[]): Promise<string[]> {
  const { rows } = await sql<{ id: string }>`select id from gateway.requests where id = any(${ids}::text[])`.execute(db);
  return rows.map((row) => row.id);
}
