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
-- The ledger of interventions (migration 0019), which the CLI writes as this role:
-- append-only. No UPDATE, DELETE or TRUNCATE (taken back if granted by hand), and no
-- INSERT on who and when (recorded_at, db_role), which the database fills in.
REVOKE ALL ON {schema}.outbox_interventions, {schema}.outbox_skipped FROM {role};
GRANT SELECT ON {schema}.outbox_interventions, {schema}.outbox_skipped TO {role};
GRANT INSERT (subscriber, subscriber_id, action, os_user, host, params, events)
    ON {schema}.outbox_interventions TO {role};
GRANT INSERT ON {schema}.outbox_skipped TO {role};
GRANT EXECUTE ON FUNCTION {schema}.outbox_part(text, integer) TO {role};
-- Retention: the relay deletes published rows through this function (SECURITY DEFINER),
-- never with DELETE on the outbox.
GRANT EXECUTE ON FUNCTION {schema}.outbox_prune(double precision, integer) TO {role};
-- Restore safety: the key-space check (it may rebase keys: SECURITY DEFINER) and what
-- recovery reads to judge a Kafka-side checkpoint.
GRANT SELECT ON {schema}.outbox_key_space TO {role};
GRANT EXECUTE ON FUNCTION {schema}.outbox_check_key_space(),
    {schema}.outbox_translate_key(uuid, xid8, bigint) TO {role};
-- The topics the outbox created (migration 0017): the relay records what it creates,
-- forgets a row's topic the broker refused, and adopts an upgraded outbox's topics once.
GRANT SELECT, INSERT, DELETE ON {schema}.outbox_topics TO {role};
GRANT SELECT, DELETE ON {schema}.outbox_topic_adoption TO {role};

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
-- Its own keyed events, which a retried append compares (migration 0015 grants the view
-- to PUBLIC; a restore without privileges drops that).
GRANT SELECT ON {schema}.outbox_own_keys TO {role};

-- name: row_security_state
-- `grant --aggregate-types` (row-level security on the outbox): whether it is on, and
-- whether the policy that keeps every other role's access as its privileges say exists.
SELECT c.relrowsecurity,
       EXISTS (SELECT FROM pg_catalog.pg_policy p
                WHERE p.polrelid = c.oid AND p.polname = 'outbox_rows')
  FROM pg_catalog.pg_class c
 WHERE c.oid = pg_catalog.to_regclass(pg_catalog.format('%%I.outbox', %(schema)s::text));

-- name: rows_policy
-- Row-level security lets a role see or write no row without a policy: this one gives
-- back every row to every role, so that privileges alone decide, as before. Restricted
-- writer roles get a restrictive policy each (writer_types_policy). The owner, and so
-- the SECURITY DEFINER functions (the Debezium copy, prune, the rebase), is not subject
-- to row-level security.
CREATE POLICY outbox_rows ON {schema}.outbox USING (true) WITH CHECK (true);

-- name: enable_row_security
ALTER TABLE {schema}.outbox ENABLE ROW LEVEL SECURITY;

-- name: writer_types_policies
-- The policies writer_types_policy made for one role (found by role, as a renamed role
-- keeps its policy and its policy's name).
SELECT p.polname FROM pg_catalog.pg_policy p
 WHERE p.polrelid = pg_catalog.to_regclass(pg_catalog.format('%%I.outbox', %(schema)s::text))
   AND NOT p.polpermissive AND p.polcmd = 'a' AND p.polname LIKE 'aggregate types of %%'
   AND p.polroles = ARRAY[(SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = %(role)s)];

-- name: drop_policy
DROP POLICY {policy} ON {schema}.outbox;

-- name: writer_types_policy
-- The writer role inserts rows of these aggregate types only, through the write API or
-- plain SQL alike: another type fails its INSERT (42501, "new row violates row-level
-- security policy").
CREATE POLICY {policy} ON {schema}.outbox AS RESTRICTIVE FOR INSERT TO {role}
    WITH CHECK (aggregate_type = ANY ({types}));
