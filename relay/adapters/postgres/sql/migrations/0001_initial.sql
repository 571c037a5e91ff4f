-- 0001: the outbox, subscribers and their checkpoints.
-- {schema} is substituted with a quoted identifier by relay.adapters.postgres.migrations.

CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE {schema}.outbox (
    -- Order within a transaction; identity, so gaps and commit races are harmless:
    -- the relay orders by (transaction_id, position), never by position alone.
    position          bigint GENERATED ALWAYS AS IDENTITY,
    -- The writer's transaction id. Leave it to its default: the relay only reads rows
    -- whose transaction_id is below pg_snapshot_xmin, i.e. whose fate is decided.
    transaction_id    xid8 NOT NULL DEFAULT pg_current_xact_id(),
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

-- A retried request with the same key writes nothing (docs/design.md §7). Partial, so rows
-- without a key cost nothing here.
CREATE UNIQUE INDEX outbox_idempotency_key
    ON {schema}.outbox (aggregate_type, aggregate_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Optimistic concurrency for event-sourced appends: one event per stream version.
CREATE UNIQUE INDEX outbox_stream_version
    ON {schema}.outbox (aggregate_type, aggregate_id, aggregate_version)
    WHERE aggregate_version IS NOT NULL;

-- A stream's versions must reach Kafka in version order, and the relay publishes in
-- transaction_id order. A transaction that took its xid early could otherwise append
-- version N+1 after a younger transaction committed version N, and N+1 would be
-- published first. Refuse that (and version gaps) so the writer retries.
CREATE FUNCTION {schema}.outbox_check_stream_order() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    previous_xid xid8;
BEGIN
    IF NEW.aggregate_version = 1 THEN
        RETURN NEW;
    END IF;
    SELECT o.transaction_id INTO previous_xid
      FROM {schema}.outbox o
     WHERE o.aggregate_type = NEW.aggregate_type
       AND o.aggregate_id = NEW.aggregate_id
       AND o.aggregate_version = NEW.aggregate_version - 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'stream %/% has no version %, cannot append version %',
            NEW.aggregate_type, NEW.aggregate_id, NEW.aggregate_version - 1, NEW.aggregate_version
            USING ERRCODE = 'RLY01';
    END IF;
    IF previous_xid > NEW.transaction_id THEN
        RAISE EXCEPTION 'stream %/% version % was written by transaction %, which started after this transaction %',
            NEW.aggregate_type, NEW.aggregate_id, NEW.aggregate_version - 1, previous_xid, NEW.transaction_id
            USING ERRCODE = 'RLY02',
                  HINT = 'retry the whole transaction: its events would otherwise be published before earlier versions';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER outbox_check_stream_order
    BEFORE INSERT ON {schema}.outbox
    FOR EACH ROW WHEN (NEW.aggregate_version IS NOT NULL)
    EXECUTE FUNCTION {schema}.outbox_check_stream_order();

-- NOTIFY is only a wake-up hint, delivered at commit; the relay also polls on a timer.
-- Statement-level so a bulk insert sends one notification.
CREATE FUNCTION {schema}.outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_relay', TG_TABLE_SCHEMA);
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_notify
    AFTER INSERT ON {schema}.outbox
    FOR EACH STATEMENT
    EXECUTE FUNCTION {schema}.outbox_notify();

CREATE TABLE {schema}.outbox_subscribers (
    name            text PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{{0,127}}$'),
    -- NULL means every aggregate type / event type.
    aggregate_types text[],
    event_types     text[],
    topic           text NOT NULL CHECK (topic <> ''),
    value_format    text NOT NULL CHECK (value_format IN ('avro', 'json')),
    paused          boolean NOT NULL DEFAULT false,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
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
    PRIMARY KEY (subscriber, part)
);
