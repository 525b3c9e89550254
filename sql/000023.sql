-- 000023: gateway.api_keys.checksummed, whether a key ends with a checksum.
--
-- A key ends with a checksum (src/ids.ts), and one that fails it is refused from its text alone.
-- Keys made before checksums have 40 characters after the prefix and none, so a key of that form
-- must be read to be judged. An API process refuses that form from its text alone too while no
-- active key lacks a checksum (src/keys/unchecksummed.ts): a flood of made-up keys of the old
-- form then costs no read either. Only a key's hash is stored, so the keys made before this
-- migration cannot be told apart: they count as without a checksum until they are revoked.
alter table gateway.api_keys add column checksummed boolean not null default false;
comment on column gateway.api_keys.checksummed is
  'Whether the key ends with a checksum: true for the keys made since sql/000023.sql; false for those made before, which may have none.';
