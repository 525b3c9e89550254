-- 000004: API processes cache keys in memory; a revoked (or deleted) key must stop working at
-- once everywhere, so every change to a key is announced.

create function gateway.notify_api_key_changed() returns trigger
  language plpgsql
  as $$
begin
  perform pg_notify('gateway_api_keys_changed', coalesce(new.id, old.id));
  return null;
end;
$$;
comment on function gateway.notify_api_key_changed() is
  'Sends NOTIFY gateway_api_keys_changed with the key id, so API processes drop it from their caches.';

create trigger api_keys_notify_changed
  after update or delete on gateway.api_keys
  for each row
  execute function gateway.notify_api_key_changed();
