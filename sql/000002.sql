-- 000002: nonces of signed POST requests, so that a captured request cannot be replayed.

create table gateway.signature_nonces (
  api_key_id text collate "C" not null references gateway.api_keys (id) on delete cascade,
  nonce text collate "C" not null constraint signature_nonces_nonce_format check (nonce ~ '^[A-Za-z0-9_-]{16,64}$'),
  expires_at timestamptz not null,
  primary key (api_key_id, nonce)
);
comment on table gateway.signature_nonces is
  'Nonces (Svc-Signature n=...) already used by each key for a POST. A nonce is refused while its row exists; '
  'rows are deleted once expired, when the signature''s timestamp could no longer pass the 300 s window anyway.';
comment on column gateway.signature_nonces.expires_at is 'Signature timestamp + 300 s: after this the row is deleted by the cleanup task.';

create index signature_nonces_expires_at on gateway.signature_nonces (expires_at);
