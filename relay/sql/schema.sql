-- The current schema, as the migrations leave it (tests/test_migrations.py checks
-- that applying every migration reproduces exactly this). Reference for DBAs.

CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE {schema}.outbox (
    -- Order within a transaction; identity, so gaps and commit races are harmless:
    -- the relay orders by (transaction_id, position), never by position alone.
    position          bigint GENERATED ALWAYS AS IDENTITY,
    -- The ordering key (docs/design.md, "Ordering"): the writer's xid8, or the xmax of
    -- the inserting statement's snapshot if that is higher, so a writer that waited for
    -- another sorts after it. Never below the writer's xid: the relay only reads rows
    -- below pg_snapshot_xmin, i.e. whose fate is decided. The trigger
    -- outbox_assign_order_key overwrites whatever a writer gives, here and in position.
    transaction_id    xid8 NOT NULL
                      DEFAULT greatest(pg_current_xact_id(), pg_snapshot_xmax(pg_current_snapshot())),
    message_id        uuid NOT NULL DEFAULT gen_random_uuid(),
    aggregate_type    text NOT NULL CHECK (aggregate_type <> ''),
    aggregate_id      text NOT NULL,
    -- Set only by event-sourced appends: the event's version within its stream.
    aggregate_version bigint CHECK (aggregate_version >= 1),
    event_type        text NOT NULL CHECK (event_type <> ''),
    payload           jsonb NOT NULL,
    headers           jsonb NOT NULL DEFAULT '{{}}'::jsonb CHECK (jsonb_typeof(headers) = 'object'),
    idempotency_key   text,
    occurred_at       timestamptz NOT NULL DEFAULT now(),
    -- Serves the relay's keyset scan: ORDER BY transaction_id, position.
    CONSTRAINT outbox_pkey PRIMARY KEY (transaction_id, position)
);

CREATE UNIQUE INDEX outbox_message_id_key ON {schema}.outbox (message_id);

-- A retried request with the same key writes nothing (seed 003). Partial, so rows
-- without a key cost nothing here.
CREATE UNIQUE INDEX outbox_idempotency_key
    ON {schema}.outbox (aggregate_type, aggregate_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Optimistic concurrency for event-sourced appends: one event per stream version.
CREATE UNIQUE INDEX outbox_stream_version
    ON {schema}.outbox (aggregate_type, aggregate_id, aggregate_version)
    WHERE aggregate_version IS NOT NULL;

-- Event-sourced appends: a version must follow the one before it (no gaps).
CREATE FUNCTION {schema}.outbox_check_stream_order() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.aggregate_version = 1 THEN
        RETURN NEW;
    END IF;
    PERFORM FROM {schema}.outbox o
      WHERE o.aggregate_type = NEW.aggregate_type
        AND o.aggregate_id = NEW.aggregate_id
        AND o.aggregate_version = NEW.aggregate_version - 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'stream %/% has no version %, cannot append version %',
            NEW.aggregate_type, NEW.aggregate_id, NEW.aggregate_version - 1, NEW.aggregate_version
            USING ERRCODE = 'RLY01';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER outbox_check_stream_order
    BEFORE INSERT ON {schema}.outbox
    FOR EACH ROW WHEN (NEW.aggregate_version IS NOT NULL)
    EXECUTE FUNCTION {schema}.outbox_check_stream_order();

-- The outbox assigns every row's ordering key and position itself (migration 0005):
-- when a writer gave other values than the defaults would, the trigger replaces them.
-- currval (in WHEN) needs SELECT on the sequence; nextval (in the function) more, hence
-- SECURITY DEFINER.
GRANT SELECT ON SEQUENCE {schema}.outbox_position_seq TO PUBLIC;

CREATE FUNCTION {schema}.outbox_assign_order_key() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.transaction_id := greatest(pg_current_xact_id(), pg_snapshot_xmax(pg_current_snapshot()));
    NEW.position := nextval(format('%I.outbox_position_seq', TG_TABLE_SCHEMA)::regclass);
    RETURN NEW;
END
$$;

REVOKE ALL ON FUNCTION {schema}.outbox_assign_order_key() FROM PUBLIC;

CREATE TRIGGER outbox_assign_order_key
    BEFORE INSERT ON {schema}.outbox
    FOR EACH ROW
    WHEN (NEW.transaction_id IS DISTINCT FROM
              greatest(pg_current_xact_id(), pg_snapshot_xmax(pg_current_snapshot()))
          OR NEW.position IS DISTINCT FROM currval('{schema}.outbox_position_seq'))
    EXECUTE FUNCTION {schema}.outbox_assign_order_key();

CREATE TABLE {schema}.outbox_subscribers (
    name            text PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{{0,127}}$'),
    -- NULL means every aggregate type / event type.
    aggregate_types text[],
    event_types     text[],
    topic           text NOT NULL CHECK (topic <> ''),
    value_format    text NOT NULL CHECK (value_format IN ('avro', 'json')),
    paused          boolean NOT NULL DEFAULT false,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    -- Stable identity: part of the Kafka transactional.id, so a subscriber recreated
    -- under the same name never inherits fencing state.
    id              uuid NOT NULL DEFAULT gen_random_uuid(),
    -- Events are sharded over parts by a hash of aggregate_id; each part has its own
    -- checkpoint and can be published by a different relay. Fixed at creation.
    parts           integer NOT NULL DEFAULT 1 CHECK (parts BETWEEN 1 AND 1024),
    on_poison       text NOT NULL DEFAULT 'halt' CHECK (on_poison IN ('halt', 'dead-letter')),
    dead_letter_topic text CHECK (dead_letter_topic <> ''),
    CONSTRAINT outbox_subscribers_id_key UNIQUE (id)
);

-- The part an event belongs to when its subscriber has `parts` parts: by a hash of
-- aggregate_id, so all of one key's events stay in one part (and in order).
CREATE FUNCTION {schema}.outbox_part(aggregate_id text, parts integer) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN ((hashtextextended(aggregate_id, 0) & 9223372036854775807) % parts)::integer;

-- One row per live relay process (seed 000). A relay heartbeats its row; any relay
-- deletes rows past expires_at, which releases their claims (owner SET NULL).
CREATE TABLE {schema}.outbox_relay_sessions (
    id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);

CREATE TABLE {schema}.outbox_checkpoints (
    subscriber     text NOT NULL REFERENCES {schema}.outbox_subscribers (name) ON DELETE CASCADE,
    part           integer NOT NULL DEFAULT 0 CHECK (part >= 0),
    -- The last published (transaction_id, position); the next poll starts after it.
    transaction_id xid8 NOT NULL,
    position       bigint NOT NULL,
    -- Compare-and-set version: every write must name the version it read.
    version        bigint NOT NULL DEFAULT 0,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    -- The session that may publish this part; NULL when unclaimed.
    owner          uuid REFERENCES {schema}.outbox_relay_sessions (id) ON DELETE SET NULL,
    -- Changes on every reset, so a Kafka-side checkpoint written before the reset
    -- (a consumer group named after the generation) is never mistaken for a newer one.
    generation     uuid NOT NULL DEFAULT gen_random_uuid(),
    -- Set when a poison event halted this part under the 'halt' policy; cleared by resume.
    halted_at      timestamptz,
    halted_error   text,
    -- Where this generation started (creation or the last reset): verify expects the
    -- events after it, up to the checkpoint.
    start_transaction_id xid8 NOT NULL DEFAULT '0',
    start_position bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (subscriber, part)
);

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
