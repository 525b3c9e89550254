-- 000019: request bodies and results compressed with lz4 where the server has it.
--
-- Postgres compresses a large value as it stores it. Its default method, pglz, is slow: a prompt
-- of a few megabytes costs tens of milliseconds of the server's CPU, even when it hardly
-- compresses. lz4 does the same work several times faster. Servers from Postgres 14 built with
-- lz4 (most packages are) have it; elsewhere the columns keep pglz. Values already stored keep
-- the method they were stored with.
--
-- The statements are run by execute: PL/pgSQL checks the syntax of the SQL written in a block
-- before it runs any of it, branches not taken included, and Postgres 13 knows no
-- `set compression`.
do $$
begin
  if exists (select from pg_settings where name = 'default_toast_compression' and 'lz4' = any (enumvals)) then
    execute 'alter table gateway.requests alter column body set compression lz4';
    execute 'alter table gateway.requests alter column result set compression lz4';
  end if;
end
$$;
