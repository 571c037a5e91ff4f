-- Exactly-once and HA: relay sessions, claimed subscriber parts, Kafka-side
-- checkpoint generations, and the poison-event policy with its recorded decisions.

-- One row per live relay process (docs/design.md §4). A relay heartbeats its row; any relay
-- deletes rows past expires_at, which releases their claims (owner SET NULL).
CREATE TABLE {schema}.outbox_relay_sessions (
    id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);

ALTER TABLE {schema}.outbox_subscribers
    -- Stable identity across renames of nothing and resets of everything: part of the
    -- Kafka transactional.id, so a recreated subscriber never inherits fencing state.
    ADD COLUMN id uuid NOT NULL DEFAULT gen_random_uuid(),
    -- Events are sharded over parts by a hash of aggregate_id; each part has its own
    -- checkpoint and can be published by a different relay. Fixed at creation.
    ADD COLUMN parts integer NOT NULL DEFAULT 1 CHECK (parts BETWEEN 1 AND 1024),
    ADD COLUMN on_poison text NOT NULL DEFAULT 'halt' CHECK (on_poison IN ('halt', 'dead-letter')),
    ADD COLUMN dead_letter_topic text CHECK (dead_letter_topic <> '');

ALTER TABLE {schema}.outbox_subscribers ADD CONSTRAINT outbox_subscribers_id_key UNIQUE (id);

-- The part an event belongs to when its subscriber has `parts` parts: by a hash of
-- aggregate_id, so all of one key's events stay in one part (and in order).
CREATE FUNCTION {schema}.outbox_part(aggregate_id text, parts integer) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN ((hashtextextended(aggregate_id, 0) & 9223372036854775807) % parts)::integer;

ALTER TABLE {schema}.outbox_checkpoints
    -- The session that may publish this part; NULL when unclaimed.
    ADD COLUMN owner uuid REFERENCES {schema}.outbox_relay_sessions (id) ON DELETE SET NULL,
    -- Changes on every reset, so a Kafka-side checkpoint written before the reset
    -- (a consumer group named after the generation) is never mistaken for a newer one.
    ADD COLUMN generation uuid NOT NULL DEFAULT gen_random_uuid(),
    -- Set when a poison event halted this part under the 'halt' policy; cleared by resume.
    ADD COLUMN halted_at timestamptz,
    ADD COLUMN halted_error text,
    -- Where this generation started (creation or the last reset): verify expects the
    -- events after it, up to the checkpoint.
    ADD COLUMN start_transaction_id xid8 NOT NULL DEFAULT '0',
    ADD COLUMN start_position bigint NOT NULL DEFAULT 0;

CREATE INDEX outbox_checkpoints_owner ON {schema}.outbox_checkpoints (owner);

-- Poison events sent to the dead-letter topic: recorded with the checkpoint advance
-- past them, so the decision is never made twice.
CREATE TABLE {schema}.outbox_dead_letters (
    subscriber     text NOT NULL REFERENCES {schema}.outbox_subscribers (name) ON DELETE CASCADE,
    part           integer NOT NULL,
    transaction_id xid8 NOT NULL,
    position       bigint NOT NULL,
    message_id     uuid NOT NULL,
    topic          text NOT NULL,
    error          text NOT NULL,
    decided_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscriber, transaction_id, position)
);
