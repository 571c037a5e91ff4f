-- Runs once, when the compose stack's Postgres initializes its data directory: the
-- login role the relay runs as. It owns nothing and gets its privileges from
-- `outbox-relay grant` (the relay-grant service) after the migrations. The password is
-- for this local stack only (the same as in ../secrets/relay-database-url: change both
-- together); in production set your own (or use certificates).
CREATE ROLE outbox_relay LOGIN PASSWORD 'outbox_relay';
