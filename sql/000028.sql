-- 000028: a nonce is kept 901 s, not 601: the API processes that check signatures may have clocks
-- that disagree with each other, and a process whose clock is behind the one that recorded a
-- nonce accepts its signature that much longer. The column's comment gives the new figure.

comment on column gateway.signature_nonces.expires_at is
  'Recorded + 901 s, by the database''s clock: twice the signature window, and the 300 s by which the API processes'' clocks may disagree, so that no API process accepts a signature after its nonce is deleted by the cleanup task.';
