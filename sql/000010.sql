-- 000010: nonces are kept by the database's clock (see below), and what the columns say.

comment on column gateway.signature_nonces.expires_at is
  'Recorded + 601 s, by the database''s clock: twice the signature window, so that a signature accepted by an API '
  'process, whatever its clock''s skew, is out of its window before its nonce is deleted by the cleanup task.';
