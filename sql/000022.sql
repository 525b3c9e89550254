-- 000022: gateway.requests.result_bytes, the size of a request's result, written with it.
--
-- A lookup reads a large result apart from the statement that reads its group of requests, and
-- chose which by measuring the result: octet_length(result::text) decompresses a stored result
-- whole, and reading it then decompresses it again. Its size is now written with it, and lookups
-- take it from there; a result stored before this migration has none, and is measured as before.
alter table gateway.requests add column result_bytes integer;
comment on column gateway.requests.result_bytes is
  'The size of result (its JSON text, in bytes), written with it; null without a result, and for results stored before sql/000022.sql.';
