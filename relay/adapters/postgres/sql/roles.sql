-- Least-privilege roles (run by `outbox-relay grant`). {schema} and {role} are quoted
-- identifiers. Each statement is idempotent.

-- name: relay_grants
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT ON {schema}.outbox, {schema}.outbox_relay_migrations TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.outbox_subscribers, {schema}.outbox_checkpoints TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.outbox_relay_sessions TO {role};
GRANT SELECT, INSERT ON {schema}.outbox_dead_letters TO {role};
-- Retention of dead letters (migration 0016): what `dead-letters prune` and the
-- relay's retention pass delete (relay/adapters/postgres/sql/queries.sql says which).
GRANT DELETE ON {schema}.outbox_dead_letters TO {role};
-- `dead-letters redrive` records its progress (migration 0010).
GRANT UPDATE (redrive_batch, redriven_at, redrive_error) ON {schema}.outbox_dead_letters TO {role};
GRANT EXECUTE ON FUNCTION {schema}.outbox_part(text, integer) TO {role};
-- Retention: the relay deletes published rows through this function (SECURITY DEFINER),
-- never with DELETE on the outbox.
GRANT EXECUTE ON FUNCTION {schema}.outbox_prune(double precision, integer) TO {role};
-- Restore safety: the key-space check (it may rebase keys: SECURITY DEFINER) and what
-- recovery reads to judge a Kafka-side checkpoint.
GRANT SELECT ON {schema}.outbox_key_space TO {role};
GRANT EXECUTE ON FUNCTION {schema}.outbox_check_key_space(),
    {schema}.outbox_translate_key(uuid, xid8, bigint) TO {role};

-- name: relay_read_all_stats
-- Only when asked (`grant --read-all-stats`): pg_stat_activity shows other roles'
-- transaction ids only to this predefined role, so the relay can name who holds the
-- publication horizon back. It also shows every session's query text.
GRANT pg_read_all_stats TO {role};

-- name: relay_no_read_all_stats
-- Without --read-all-stats, take back what earlier versions of `grant` gave.
REVOKE pg_read_all_stats FROM {role};

-- name: writer_grants
GRANT USAGE ON SCHEMA {schema} TO {role};
-- Reads only what the write API reads back (message ids; idempotency keys and stream
-- versions, which it checks): never another writer's payloads or headers. Revoking the
-- table-wide SELECT earlier versions gave takes back its column privileges too.
REVOKE SELECT ON {schema}.outbox FROM {role};
GRANT SELECT (message_id, aggregate_type, aggregate_id, aggregate_version, idempotency_key)
    ON {schema}.outbox TO {role};
-- The stream-order trigger's WHEN reads currval of the position's sequence (migration
-- 0005). 0005 granted that to PUBLIC, which a restore without privileges drops.
GRANT SELECT ON SEQUENCE {schema}.outbox_position_seq TO {role};
-- Every column but the ordering key and the position: writers cannot forge either.
REVOKE INSERT ON {schema}.outbox FROM {role};
GRANT INSERT (message_id, aggregate_type, aggregate_id, aggregate_version, event_type,
              payload, headers, idempotency_key, occurred_at)
    ON {schema}.outbox TO {role};
