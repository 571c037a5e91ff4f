-- The current schema, as the migrations leave it (tests/integration/test_migrations.py
-- checks that applying every migration reproduces exactly this). Reference for DBAs.

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
                      DEFAULT greatest(pg_catalog.pg_current_xact_id(),
                                       pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())),
    message_id        uuid NOT NULL DEFAULT pg_catalog.gen_random_uuid(),
    aggregate_type    text NOT NULL CHECK (aggregate_type <> ''),
    aggregate_id      text NOT NULL,
    -- Set only by event-sourced appends: the event's version within its stream.
    aggregate_version bigint CHECK (aggregate_version >= 1),
    event_type        text NOT NULL CHECK (event_type <> ''),
    payload           jsonb NOT NULL,
    headers           jsonb NOT NULL DEFAULT '{{}}'::jsonb
                      CHECK (pg_catalog.jsonb_typeof(headers) = 'object'),
    idempotency_key   text,
    occurred_at       timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- When the database recorded the row: the start of its INSERT statement (migration
    -- 0018). The lag and stall figures read it, never occurred_at, which writers set;
    -- writers get no INSERT on it, and outbox_assign_recorded_at overwrites any value.
    recorded_at       timestamptz NOT NULL DEFAULT pg_catalog.statement_timestamp(),
    -- Set only on rows copied by `outbox-relay debezium attach` (migration 0006): what
    -- Debezium's Outbox Event Router would publish for them (relay/engine/debezium_format.py).
    debezium          jsonb,
    -- The role that inserted the row (migration 0015): it scopes idempotency keys. The
    -- trigger outbox_assign_writer overwrites whatever a writer gives. NULL on rows
    -- written before 0015.
    writer            text DEFAULT CURRENT_USER,
    -- Serves the relay's keyset scan: ORDER BY transaction_id, position.
    CONSTRAINT outbox_pkey PRIMARY KEY (transaction_id, position)
);

CREATE UNIQUE INDEX outbox_message_id_key ON {schema}.outbox (message_id);

-- A retried request with the same key writes nothing (docs/design.md §7). Per writer
-- (migration 0015): one writer's key never holds another's event back. Partial, so rows
-- without a key cost nothing here.
CREATE UNIQUE INDEX outbox_idempotency_key
    ON {schema}.outbox (aggregate_type, aggregate_id, idempotency_key, writer)
    WHERE idempotency_key IS NOT NULL;

-- Serves subscribers of one aggregate type: their poll reads only their own rows, in
-- publication order (migration 0007).
CREATE INDEX outbox_aggregate_type_order
    ON {schema}.outbox (aggregate_type, transaction_id, position);

-- Optimistic concurrency for event-sourced appends: one event per stream version.
CREATE UNIQUE INDEX outbox_stream_version
    ON {schema}.outbox (aggregate_type, aggregate_id, aggregate_version)
    WHERE aggregate_version IS NOT NULL;

-- Event-sourced appends: a version must follow the one before it (no gaps). It runs in
-- the writer's session, under the writer's search_path: its operators are qualified
-- (migration 0014) rather than the path set, which costs about 4 us a call, a row of
-- every stream append.
CREATE FUNCTION {schema}.outbox_check_stream_order() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    previous bigint := NEW.aggregate_version OPERATOR(pg_catalog.-) 1;
BEGIN
    IF previous OPERATOR(pg_catalog.=) 0 THEN
        RETURN NEW;
    END IF;
    PERFORM FROM {schema}.outbox o
      WHERE o.aggregate_type OPERATOR(pg_catalog.=) NEW.aggregate_type
        AND o.aggregate_id OPERATOR(pg_catalog.=) NEW.aggregate_id
        AND o.aggregate_version OPERATOR(pg_catalog.=) previous;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'stream %/% has no version %, cannot append version %',
            NEW.aggregate_type, NEW.aggregate_id, previous, NEW.aggregate_version
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
    NEW.transaction_id := greatest(pg_catalog.pg_current_xact_id(),
                                   pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot()));
    NEW.position := pg_catalog.nextval(
        pg_catalog.format('%I.outbox_position_seq', TG_TABLE_SCHEMA)::regclass);
    RETURN NEW;
END
$$;

REVOKE ALL ON FUNCTION {schema}.outbox_assign_order_key() FROM PUBLIC;

CREATE TRIGGER outbox_assign_order_key
    BEFORE INSERT ON {schema}.outbox
    FOR EACH ROW
    WHEN (NEW.transaction_id IS DISTINCT FROM
              greatest(pg_catalog.pg_current_xact_id(),
                       pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot()))
          OR NEW.position IS DISTINCT FROM
              pg_catalog.currval('{schema}.outbox_position_seq'::regclass))
    EXECUTE FUNCTION {schema}.outbox_assign_order_key();

-- The writer of a row is the inserting role, whatever a role that may name the column
-- gives (migration 0015). Not SECURITY DEFINER: CURRENT_USER must be the inserting role.
CREATE FUNCTION {schema}.outbox_assign_writer() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.writer := CURRENT_USER;
    RETURN NEW;
END
$$;

CREATE TRIGGER outbox_assign_writer
    BEFORE INSERT ON {schema}.outbox
    FOR EACH ROW WHEN (NEW.writer IS DISTINCT FROM CURRENT_USER)
    EXECUTE FUNCTION {schema}.outbox_assign_writer();

-- What a retry compares (migration 0015): the querying role's own keyed events, payloads
-- included, and no other role's.
CREATE VIEW {schema}.outbox_own_keys WITH (security_barrier) AS
SELECT o.message_id, o.aggregate_type, o.aggregate_id, o.idempotency_key, o.event_type,
       o.payload
  FROM {schema}.outbox o
 WHERE o.idempotency_key IS NOT NULL AND o.writer = CURRENT_USER;

GRANT SELECT ON {schema}.outbox_own_keys TO PUBLIC;

-- Key-like columns are bounded (migration 0008), so a writer gets a clear error at
-- INSERT instead of an index or the relay failing later (docs/writing-events.md, "Limits"). In bytes: the
-- widest index entry (outbox_idempotency_key: type, id, key and writer) then stays below the
-- B-tree limit (2704 bytes), so a row within the limits never fails. NOT VALID: rows
-- written before migration 0008 are not scanned (no long lock on a large outbox, and no
-- failed upgrade for an old oversized row); every new row is checked.
ALTER TABLE {schema}.outbox
    ADD CONSTRAINT outbox_aggregate_type_length
        CHECK (pg_catalog.octet_length(aggregate_type) <= 255) NOT VALID,
    ADD CONSTRAINT outbox_event_type_length
        CHECK (pg_catalog.octet_length(event_type) <= 255) NOT VALID,
    ADD CONSTRAINT outbox_aggregate_id_length
        CHECK (pg_catalog.octet_length(aggregate_id) <= 1024) NOT VALID,
    ADD CONSTRAINT outbox_idempotency_key_length
        CHECK (pg_catalog.octet_length(idempotency_key) <= 1024) NOT VALID,
    ADD CONSTRAINT outbox_headers_size
        CHECK (pg_catalog.octet_length(headers::text) <= 65536) NOT VALID;

-- The ordering key and position are the outbox's, never a writer's (migration 0008):
-- a key moved above the cluster's ids looked like a restore and made the relay rebase. Only the
-- rebase changes them (it disables this trigger inside its own transaction).
CREATE FUNCTION {schema}.outbox_freeze_order_key() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'the outbox''s transaction_id and position cannot be changed (row %, %)',
        OLD.transaction_id, OLD.position
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'the outbox assigns both; write a new event instead';
END
$$;

CREATE TRIGGER outbox_freeze_order_key
    BEFORE UPDATE OF transaction_id, position ON {schema}.outbox
    FOR EACH ROW
    WHEN (NEW.transaction_id IS DISTINCT FROM OLD.transaction_id
          OR NEW.position IS DISTINCT FROM OLD.position)
    EXECUTE FUNCTION {schema}.outbox_freeze_order_key();

-- recorded_at is the database's, never a writer's (migration 0018): a role that holds
-- INSERT on every column gets the statement's time whatever it gives.
CREATE FUNCTION {schema}.outbox_assign_recorded_at() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.recorded_at := pg_catalog.statement_timestamp();
    RETURN NEW;
END
$$;

REVOKE ALL ON FUNCTION {schema}.outbox_assign_recorded_at() FROM PUBLIC;

CREATE TRIGGER outbox_assign_recorded_at
    BEFORE INSERT ON {schema}.outbox
    FOR EACH ROW
    WHEN (NEW.recorded_at IS DISTINCT FROM pg_catalog.statement_timestamp())
    EXECUTE FUNCTION {schema}.outbox_assign_recorded_at();

CREATE TABLE {schema}.outbox_subscribers (
    name            text PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{{0,127}}$'),
    -- NULL means every aggregate type / event type.
    aggregate_types text[],
    event_types     text[],
    topic           text NOT NULL CHECK (topic <> ''),
    value_format    text NOT NULL
        CHECK (value_format IN ('avro', 'json', 'debezium', 'avro-registry')),
    paused          boolean NOT NULL DEFAULT false,
    created_at      timestamptz NOT NULL DEFAULT pg_catalog.now(),
    updated_at      timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- Stable identity: part of the Kafka transactional.id, so a subscriber recreated
    -- under the same name never inherits fencing state.
    id              uuid NOT NULL DEFAULT pg_catalog.gen_random_uuid(),
    -- Events are sharded over parts by a hash of aggregate_id; each part has its own
    -- checkpoint and can be published by a different relay. Fixed at creation.
    parts           integer NOT NULL DEFAULT 1 CHECK (parts BETWEEN 1 AND 1024),
    on_poison       text NOT NULL DEFAULT 'halt' CHECK (on_poison IN ('halt', 'dead-letter')),
    dead_letter_topic text CHECK (dead_letter_topic <> ''),
    CONSTRAINT outbox_subscribers_id_key UNIQUE (id),
    -- The registry subject of an avro-registry subscriber's schemas (relay/core/subscribers.py).
    subject_strategy text NOT NULL DEFAULT 'topic'
        CHECK (subject_strategy IN ('topic', 'record', 'topic-record')),
    -- The record key: the aggregate_id as text, or registry-encoded (avro-registry only).
    key_format text NOT NULL DEFAULT 'string'
        CHECK (key_format IN ('string', 'avro-registry')),
    -- Routing control (0013, relay/core/routing.py): key template, partition field and
    -- placements; NULL: the defaults.
    routing jsonb CHECK (routing IS NULL OR pg_catalog.jsonb_typeof(routing) = 'object')
);

-- The part an event belongs to when its subscriber has `parts` parts: by a hash of
-- aggregate_id, so all of one key's events stay in one part (and in order). Inlined
-- into the queries and the part indexes' predicates, so no SET search_path (it would
-- stop that): its body is bound when created, every call qualified and every operand
-- of its exact type (migration 0014).
CREATE FUNCTION {schema}.outbox_part(aggregate_id text, parts integer) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN ((pg_catalog.hashtextextended(aggregate_id, 0::bigint) & 9223372036854775807::bigint)
        % parts::bigint)::integer;

-- One row per live relay process (docs/design.md §4). A relay heartbeats its row; any relay
-- deletes rows past expires_at, which releases their claims (owner SET NULL).
CREATE TABLE {schema}.outbox_relay_sessions (
    id           uuid PRIMARY KEY DEFAULT pg_catalog.gen_random_uuid(),
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT pg_catalog.now(),
    heartbeat_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
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
    updated_at     timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- The session that may publish this part; NULL when unclaimed.
    owner          uuid REFERENCES {schema}.outbox_relay_sessions (id) ON DELETE SET NULL,
    -- Changes on every reset, so a Kafka-side checkpoint written before the reset
    -- (a consumer group named after the generation) is never mistaken for a newer one.
    generation     uuid NOT NULL DEFAULT pg_catalog.gen_random_uuid(),
    -- Set when a poison event halted this part under the 'halt' policy; cleared by resume.
    halted_at      timestamptz,
    halted_error   text,
    -- Where this generation started (creation or the last reset): verify expects the
    -- events after it, up to the checkpoint.
    start_transaction_id xid8 NOT NULL DEFAULT '0',
    start_position bigint NOT NULL DEFAULT 0,
    -- Where the last reset forward jumped from: the rows after it, up to the start,
    -- were skipped by that reset (NULL: nothing skipped). Migration 0009.
    skipped_from_transaction_id xid8,
    skipped_from_position bigint,
    -- The events the operator skipped (`subscribers skip`, migration 0019): the relay
    -- drops them when it meets them, and reads only those after the checkpoint.
    skip_message_ids uuid[],
    -- The event a poison halt stopped on (0019); read only while halted_error is set.
    halted_message_id uuid,
    -- What the part waits for (a topic, a privilege, an ACL, a service: RelayError's
    -- waits_on), why and since when; NULL while it waits for nothing. Written by its
    -- owner, for `status` (migration 0020).
    waiting_on     text,
    waiting_error  text,
    waiting_since  timestamptz,
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
    decided_at     timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- Redrive (migration 0010): the redrive transaction in flight, when the event was
    -- published again, and why the last redrive left it here.
    redrive_batch  bigint,
    redriven_at    timestamptz,
    redrive_error  text,
    PRIMARY KEY (subscriber, transaction_id, position)
);
-- The outbox's retention keeps a dead letter's event until it is redriven (0016).
CREATE INDEX outbox_dead_letters_pending
    ON {schema}.outbox_dead_letters (transaction_id, position) WHERE redriven_at IS NULL;

-- The ledger of interventions (migration 0019): every operator action that changes what
-- a subscriber publishes (skip, reset, replay, redrive, set, pause, resume, remove, add,
-- replace), with who (the database role, and the OS user and host the command line
-- reports), when, what (the action's parameters) and how many events. Keyed by the subscriber's name and id, with
-- no foreign key: it outlives `subscribers remove`. Append-only for the relay role
-- (roles.sql grants INSERT, and not on recorded_at and db_role, which the database
-- fills in: a client cannot write another role's name or another time).
CREATE TABLE {schema}.outbox_interventions (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscriber    text NOT NULL,
    subscriber_id uuid,
    action        text NOT NULL CHECK (action IN ('add', 'replace', 'set', 'pause', 'resume',
                                                  'reset', 'skip', 'remove', 'redrive', 'replay',
                                                  'prune')),
    recorded_at   timestamptz NOT NULL DEFAULT pg_catalog.statement_timestamp(),
    -- session_user is SQL syntax, not a function looked up on the search_path.
    db_role       text NOT NULL DEFAULT session_user,
    os_user       text CHECK (pg_catalog.octet_length(os_user) <= 256),
    host          text CHECK (pg_catalog.octet_length(host) <= 256),
    params        jsonb NOT NULL DEFAULT '{{}}'::jsonb
                  CHECK (pg_catalog.jsonb_typeof(params) = 'object'),
    -- Events the action skipped, republished or changed course for; NULL: not counted.
    events        bigint CHECK (events >= 0)
);

CREATE INDEX outbox_interventions_subscriber ON {schema}.outbox_interventions (subscriber, id);

-- What the operator skipped, per part: one event (`subscribers skip`), or the range a
-- reset forward jumped over, (after, upto], with the part's events in it that the
-- subscriber's filters match. status, subscribers list and verify read it: every
-- skip stays reported, across any number of later resets. Append-only, as the ledger.
CREATE TABLE {schema}.outbox_skipped (
    intervention  bigint NOT NULL REFERENCES {schema}.outbox_interventions (id),
    subscriber_id uuid NOT NULL,
    part          integer NOT NULL CHECK (part >= 0),
    message_id    uuid,
    after_transaction_id xid8,
    after_position bigint,
    upto_transaction_id xid8,
    upto_position bigint,
    events        bigint NOT NULL CHECK (events >= 0),
    CONSTRAINT outbox_skipped_event_or_range CHECK (
        (message_id IS NOT NULL AND events = 1 AND after_transaction_id IS NULL
         AND after_position IS NULL AND upto_transaction_id IS NULL AND upto_position IS NULL)
        OR (message_id IS NULL AND after_transaction_id IS NOT NULL
            AND after_position IS NOT NULL AND upto_transaction_id IS NOT NULL
            AND upto_position IS NOT NULL))
);

CREATE INDEX outbox_skipped_part ON {schema}.outbox_skipped (subscriber_id, part);
CREATE UNIQUE INDEX outbox_skipped_event ON {schema}.outbox_skipped (subscriber_id, message_id)
    WHERE message_id IS NOT NULL;

-- Restore safety (docs/design.md, "Moving the database"): which xid space the keys are
-- in, and the check every relay connection runs before it publishes or prunes.
-- One row: which key space the stored keys are in, and the highest id seen in it.
CREATE TABLE {schema}.outbox_key_space (
    singleton         boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    -- Changes when the keys are rebased: Kafka-side checkpoints carry it, so one
    -- written in another key space is never compared with these keys.
    id                uuid NOT NULL DEFAULT pg_catalog.gen_random_uuid(),
    previous_id       uuid,
    system_identifier bigint NOT NULL,
    -- A transaction id of this space at the last check: a cluster whose next id is
    -- not above it (and above every stored key) is not the cluster that wrote them.
    high_water        xid8 NOT NULL,
    -- Set when the cluster changed but the keys carried on (pg_upgrade, or a restore
    -- into a cluster whose ids were already higher): the highest key from before it.
    moved_high        xid8,
    checked_at        timestamptz NOT NULL DEFAULT pg_catalog.now(),
    rebased_at        timestamptz,
    rebased_rows      bigint NOT NULL DEFAULT 0
);

INSERT INTO {schema}.outbox_key_space (system_identifier, high_water)
SELECT system_identifier, pg_catalog.pg_current_xact_id() FROM pg_catalog.pg_control_system();

-- Each rebased row's key before the rebase: a Kafka-side checkpoint written in the
-- previous key space is translated through it.
CREATE TABLE {schema}.outbox_rebased_keys (
    from_key_space        uuid NOT NULL,
    origin_transaction_id xid8 NOT NULL,
    origin_position       bigint NOT NULL,
    position              bigint NOT NULL,
    PRIMARY KEY (from_key_space, origin_transaction_id, origin_position)
);

-- Called by every relay connection before it publishes or prunes (and by migrate):
-- checks that the stored keys belong to this cluster's xid space and, if not, rebases
-- them. SECURITY DEFINER, so the relay role needs no UPDATE on the outbox's keys.
-- Returns what it did: 'unchanged', 'continued' (the cluster changed, the key space did
-- not) or 'rebased', with the rows moved.
CREATE FUNCTION {schema}.outbox_check_key_space(
    OUT action text, OUT key_space uuid, OUT rebased_rows bigint, OUT detail text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    marker {schema}.outbox_key_space;
    system bigint;
    mine xid8;
    high xid8;
    trusted xid8;
    moved boolean;
BEGIN
    SELECT * INTO marker FROM {schema}.outbox_key_space FOR UPDATE;  -- one check at a time
    SELECT system_identifier INTO system FROM pg_catalog.pg_control_system();
    -- One snapshot for all: a row it sees committed before it was taken, so its key is
    -- at most the snapshot's xmax (docs/design.md). Above it: written elsewhere.
    SELECT greatest(marker.high_water,
                    (SELECT pg_catalog.max(transaction_id) FROM {schema}.outbox_checkpoints)),
           (SELECT pg_catalog.max(transaction_id) FROM {schema}.outbox),
           pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())
      INTO trusted, high, mine;
    high := greatest(trusted, high);
    -- Evidence of a move, which no writer can forge: high_water is written by this
    -- check only, checkpoints by relays only (from published rows, so below the ids of
    -- the cluster that wrote them).
    moved := system <> marker.system_identifier OR trusted > mine;
    key_space := marker.id;
    rebased_rows := 0;
    IF high > mine AND moved THEN
        rebased_rows := {schema}.outbox_rebase_keys(marker);
        action := 'rebased';
        detail := pg_catalog.format('stored keys reach %s but this cluster is at %s', high, mine);
        SELECT id INTO key_space FROM {schema}.outbox_key_space;
    ELSIF system <> marker.system_identifier THEN
        action := 'continued';
        detail := pg_catalog.format(
            'cluster %s replaced %s; its ids (%s) are above every stored key (%s)',
            system, marker.system_identifier, mine, high);
        UPDATE {schema}.outbox_key_space SET moved_high = high;
    ELSE
        action := 'unchanged';
        IF high > mine THEN
            detail := pg_catalog.format(
                'a stored key (%s) is above this cluster''s ids (%s), but the '
                'cluster is the one that wrote the keys: not rebased', high, mine);
        END IF;
    END IF;
    UPDATE {schema}.outbox_key_space
       SET system_identifier = system, high_water = mine, checked_at = pg_catalog.now();
END
$$;

-- Gives every row copied from the old key space the key ('1', a fresh position), in the
-- old order: below every key this cluster can hand out (its ids start at 3), so the
-- copies are published first and in their order, and rows written here follow them.
-- Copies are told from rows written here by their inserting transaction: a restore
-- copies the table before any writer runs here, so a row not younger than the copies
-- that are certainly old (keys above this cluster's ids, and the lowest position, which
-- the restored sequence guarantees is old) is a copy.
CREATE FUNCTION {schema}.outbox_rebase_keys(marker {schema}.outbox_key_space)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET lock_timeout = '5s' AS $$
DECLARE
    copied_age integer;
    moved bigint := 0;
    old_row record;
    new_position bigint;
    next_space uuid := pg_catalog.gen_random_uuid();
BEGIN
    -- Writers wait (briefly) and their rows in flight are decided before we look.
    LOCK TABLE {schema}.outbox IN SHARE ROW EXCLUSIVE MODE;
    LOCK TABLE {schema}.outbox_checkpoints, {schema}.outbox_dead_letters IN EXCLUSIVE MODE;
    SELECT pg_catalog.min(pg_catalog.age(o.xmin)) INTO copied_age
      FROM {schema}.outbox o, pg_catalog.pg_current_snapshot() AS s
     WHERE o.transaction_id > pg_catalog.pg_snapshot_xmax(s)
        OR o.position = (SELECT pg_catalog.min(position) FROM {schema}.outbox);
    -- The one writer of the keys: in this transaction only (the lock above keeps every
    -- other session from writing meanwhile).
    ALTER TABLE {schema}.outbox DISABLE TRIGGER outbox_freeze_order_key;
    FOR old_row IN
        SELECT o.transaction_id, o.position FROM {schema}.outbox o
         WHERE pg_catalog.age(o.xmin) >= copied_age
         ORDER BY o.transaction_id, o.position
    LOOP
        -- An identity column takes only DEFAULT in an UPDATE: one row at a time keeps
        -- the fresh positions in the old order.
        UPDATE {schema}.outbox SET transaction_id = '1', position = DEFAULT
         WHERE transaction_id = old_row.transaction_id AND position = old_row.position
        RETURNING position INTO new_position;
        INSERT INTO {schema}.outbox_rebased_keys VALUES
            (marker.id, old_row.transaction_id, old_row.position, new_position);
        moved := moved + 1;
    END LOOP;
    ALTER TABLE {schema}.outbox ENABLE TRIGGER outbox_freeze_order_key;
    -- Checkpoints (and where each generation started) move to the last copy at or
    -- before them; none: before every row.
    UPDATE {schema}.outbox_checkpoints c
       SET transaction_id = t.xid, position = t.pos,
           start_transaction_id = s.xid, start_position = s.pos,
           version = c.version + 1, updated_at = pg_catalog.now()
      FROM {schema}.outbox_checkpoints old,
           LATERAL {schema}.outbox_translate_key(marker.id, old.transaction_id, old.position) t,
           LATERAL {schema}.outbox_translate_key(marker.id, old.start_transaction_id,
                                                 old.start_position) s
     WHERE c.subscriber = old.subscriber AND c.part = old.part;
    UPDATE {schema}.outbox_dead_letters d
       SET transaction_id = '1', position = r.position
      FROM {schema}.outbox_rebased_keys r
     WHERE r.from_key_space = marker.id
       AND (d.transaction_id, d.position) = (r.origin_transaction_id, r.origin_position);
    UPDATE {schema}.outbox_key_space
       SET id = next_space, previous_id = marker.id, moved_high = NULL,
           rebased_at = pg_catalog.now(), rebased_rows = moved;
    RETURN moved;
END
$$;

-- A key of the key space ``from_space`` as a key of the one rebased from it: the last
-- rebased row at or before it ('0', 0 when there is none).
CREATE FUNCTION {schema}.outbox_translate_key(
    from_space uuid, at_transaction_id xid8, at_position bigint,
    OUT xid xid8, OUT pos bigint)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT CASE WHEN pg_catalog.max(r.position) IS NULL THEN '0'::xid8 ELSE '1'::xid8 END,
           coalesce(pg_catalog.max(r.position), 0)
      FROM {schema}.outbox_rebased_keys r
     WHERE r.from_key_space = from_space
       AND (r.origin_transaction_id, r.origin_position) <= (at_transaction_id, at_position);
END;

-- SECURITY DEFINER: only the roles `outbox-relay grant` names may call them.
REVOKE EXECUTE ON FUNCTION {schema}.outbox_check_key_space(),
    {schema}.outbox_rebase_keys({schema}.outbox_key_space),
    {schema}.outbox_translate_key(uuid, xid8, bigint) FROM PUBLIC;

-- Retention without DELETE on the outbox (migration 0008): the relay role may delete
-- published rows past the retention, and only those. The bound is read here, from the checkpoints,
-- once per batch (a reset that moves a checkpoint back stops the deletion there).
-- One batch per call: short transactions, so autovacuum keeps up. A stream's latest
-- version stays: the next event-sourced append checks that it exists, and so does a
-- dead letter's event until it is redriven (migration 0016).
CREATE FUNCTION {schema}.outbox_prune(older_than_s double precision, batch_size integer)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    bound record;
    deleted bigint;
BEGIN
    IF older_than_s IS NULL OR older_than_s < 0 OR batch_size IS NULL OR batch_size < 1 THEN
        RAISE EXCEPTION 'outbox_prune: older_than_s must be >= 0 and batch_size >= 1'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The oldest part checkpoint of all subscribers: every row at or before it is
    -- published for everyone (none when there is no subscriber: prune nothing).
    SELECT c.transaction_id, c.position INTO bound FROM {schema}.outbox_checkpoints c
     ORDER BY c.transaction_id, c.position
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    WITH doomed AS (
        SELECT o.ctid FROM {schema}.outbox o
         WHERE (o.transaction_id, o.position) <= (bound.transaction_id, bound.position)
           AND o.recorded_at < pg_catalog.now() - pg_catalog.make_interval(secs => older_than_s)
           AND (o.aggregate_version IS NULL OR EXISTS (
                 SELECT 1 FROM {schema}.outbox n
                  WHERE n.aggregate_type = o.aggregate_type AND n.aggregate_id = o.aggregate_id
                    AND n.aggregate_version = o.aggregate_version + 1))
           -- A dead letter not yet redriven: redrive reads its event here.
           AND NOT EXISTS (
                 SELECT 1 FROM {schema}.outbox_dead_letters d
                  WHERE d.transaction_id = o.transaction_id AND d.position = o.position
                    AND d.redriven_at IS NULL)
         ORDER BY o.transaction_id, o.position
         LIMIT batch_size
    )
    DELETE FROM {schema}.outbox WHERE ctid IN (SELECT ctid FROM doomed);
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;

-- Debezium-style tables copy their rows through one SECURITY DEFINER function
-- (migration 0008). Its options (topic, headers...) were trigger arguments, so any role able to create a
-- trigger (on a TEMP table of its own) could publish what it liked, where it liked. Now
-- they are read from this registry, which only the owner writes (`outbox-relay debezium
-- attach` / `detach`), keyed by the attached table (regclass: a dump and restore keeps
-- the entry with its table); a table not in it is refused.
CREATE TABLE {schema}.outbox_debezium_tables (
    source      regclass PRIMARY KEY,
    options     jsonb NOT NULL CHECK (pg_catalog.jsonb_typeof(options) = 'object'),
    attached_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);

-- One function serves every attached table. It must never fail the app's INSERT into an
-- attached table for a row Debezium accepts: every column is read through row_to_json (a
-- renamed or missing column reads as absent, any type reads as JSON), nothing is cast
-- that could fail, key-like values beyond the outbox's limits are cut (the copy keeps
-- them whole for the `debezium` format), and what the Event Router would refuse is
-- recorded in the copy for the relay to apply its poison policy to, with the reason.
-- SECURITY DEFINER: the app's role needs no privilege on the relay's outbox. EXECUTE is
-- nobody's but the owner's: only `debezium attach` creates triggers on it.
CREATE FUNCTION {schema}.outbox_from_debezium() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    opts jsonb;
    r json := pg_catalog.row_to_json(NEW);
    payload_column text;
    payload_json json;
    payload text;
    route json;
    event_key json;
    event_id json;
    descriptor jsonb;
    body jsonb;
    message uuid;
    routed text;
    keyed text;
    typed text;
BEGIN
    SELECT d.options INTO opts FROM {schema}.outbox_debezium_tables d WHERE d.source = TG_RELID;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'table %.% is not attached to the relay''s outbox',
            TG_TABLE_SCHEMA, TG_TABLE_NAME
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'the owner attaches tables with `outbox-relay debezium attach`';
    END IF;
    payload_column := opts ->> 'payload';
    payload_json := r -> payload_column;
    route := r -> (opts ->> 'route');
    event_key := r -> (opts ->> 'key');
    event_id := r -> (opts ->> 'id');
    -- The payload as the connector reads it: the column's text output (jsonb's own
    -- canonical text, json verbatim, bytea as \x hex).
    IF pg_catalog.json_typeof(payload_json) IS DISTINCT FROM 'null' THEN
        payload := CASE WHEN opts ->> 'payload_kind' IN ('json', 'jsonb')
                        THEN payload_json::text ELSE r ->> payload_column END;
    END IF;
    -- The payload for the relay's own formats (json, avro): JSON when it is JSON.
    body := 'null'::jsonb;
    IF payload IS NOT NULL AND opts ->> 'payload_kind' = 'jsonb' THEN
        body := payload_json::jsonb;
    ELSIF payload IS NOT NULL AND opts ->> 'payload_kind' <> 'bytea' THEN
        BEGIN  -- json, or text holding JSON (this block writes nothing: no subxid)
            body := payload::jsonb;
        EXCEPTION WHEN others THEN
            body := pg_catalog.to_jsonb(payload);
        END;
    ELSIF payload IS NOT NULL THEN
        body := pg_catalog.to_jsonb(payload);
    END IF;
    descriptor := pg_catalog.jsonb_build_object(
        'topic', CASE WHEN pg_catalog.json_typeof(route) = 'string'
                      THEN pg_catalog.replace(opts ->> 'replacement', '${{routedByValue}}',
                                              route #>> '{{}}') END,
        'route', route::jsonb,
        'key', event_key::jsonb,
        'id', event_id::jsonb,
        'payload', payload,
        'payload_kind', opts -> 'payload_kind',
        'timestamp', r -> (opts ->> 'timestamp'),
        'trace', r ->> (opts ->> 'tracing'),
        'converters', opts -> 'converters');
    -- The subqueries below run only when they have something to do: this runs per row.
    IF opts -> 'headers' <> '[]' THEN
        descriptor := descriptor || pg_catalog.jsonb_build_object('headers',
            (SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_array(h ->> 1, r -> (h ->> 0)))
               FROM pg_catalog.jsonb_array_elements(opts -> 'headers') h));
    END IF;
    IF opts -> 'envelope' <> '[]' THEN
        descriptor := descriptor || pg_catalog.jsonb_build_object('envelope',
            (SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_array(e ->> 1, r -> (e ->> 0)))
               FROM pg_catalog.jsonb_array_elements(opts -> 'envelope') e));
    END IF;
    -- table.fields.additional.placement=<column>:partition (migration 0013).
    IF opts ->> 'partition' IS NOT NULL THEN
        descriptor := descriptor
            || pg_catalog.jsonb_build_object('partition', r -> (opts ->> 'partition'));
    END IF;
    -- A column that is gone reads as SQL NULL (a NULL value reads as JSON null).
    IF event_id IS NULL OR payload_json IS NULL OR route IS NULL
       OR pg_catalog.jsonb_array_length(opts -> 'required') > 3 THEN
        descriptor := descriptor || pg_catalog.jsonb_build_object('missing',
            (SELECT pg_catalog.jsonb_agg(c)
               FROM pg_catalog.jsonb_array_elements_text(opts -> 'required') c
              WHERE r -> c IS NULL));
    END IF;
    IF TG_OP = 'UPDATE' THEN
        -- table.op.invalid.behavior=fatal: Debezium stops on an UPDATE of its outbox;
        -- the relay stops the subscriber here, by its poison policy.
        descriptor := descriptor || pg_catalog.jsonb_build_object('error', pg_catalog.format(
            'the row with id %s of %I.%I was updated, and table.op.invalid.behavior is fatal',
            event_id, TG_TABLE_SCHEMA, TG_TABLE_NAME));
    END IF;
    IF pg_catalog.json_typeof(event_id) = 'string' AND (event_id #>> '{{}}') ~*
            '^[0-9a-f]{{8}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{12}}$' THEN
        message := (event_id #>> '{{}}')::uuid;
    ELSE
        message := pg_catalog.gen_random_uuid();
    END IF;
    -- Within the outbox's limits (in bytes; a character takes at most 4).
    routed := coalesce(nullif(route #>> '{{}}', ''), '-');
    keyed := coalesce(event_key #>> '{{}}', '');
    typed := coalesce(nullif(r ->> (opts ->> 'type'), ''), '-');
    IF pg_catalog.octet_length(routed) > 255 THEN routed := pg_catalog.left(routed, 63); END IF;
    IF pg_catalog.octet_length(keyed) > 1024 THEN keyed := pg_catalog.left(keyed, 256); END IF;
    IF pg_catalog.octet_length(typed) > 255 THEN typed := pg_catalog.left(typed, 63); END IF;
    INSERT INTO {schema}.outbox
        (message_id, aggregate_type, aggregate_id, event_type, payload, debezium)
    VALUES (message, routed, keyed, typed, body, descriptor)
    ON CONFLICT (message_id) DO NOTHING;
    IF NOT FOUND THEN  -- the id is taken (another table, or a row re-inserted): keep both
        INSERT INTO {schema}.outbox
            (message_id, aggregate_type, aggregate_id, event_type, payload, debezium)
        VALUES (pg_catalog.gen_random_uuid(), routed, keyed, typed, body, descriptor);
    END IF;
    RETURN NULL;
END
$$;

-- SECURITY DEFINER: only the roles `outbox-relay grant` names may call them.
REVOKE EXECUTE ON FUNCTION {schema}.outbox_prune(double precision, integer),
    {schema}.outbox_from_debezium() FROM PUBLIC;

-- The topics this outbox created (migration 0017; docs/design.md §7, "Rows name
-- topics"): a row whose template field is free may publish to an existing topic only if
-- it is recorded here, a filter names it, or topic_allow matches it. The rows' topics
-- count against max_created_topics here.
CREATE TABLE {schema}.outbox_topics (
    topic       text PRIMARY KEY CHECK (pg_catalog.octet_length(topic) BETWEEN 1 AND 249),
    -- 'row': a row's free template field named it (counted against max_created_topics);
    -- 'declared': a subscriber's fixed topic, or one its filters name (never counted);
    -- 'adopted': on the cluster when a relay first started after migration 0017.
    origin      text NOT NULL CHECK (origin IN ('row', 'declared', 'adopted')),
    recorded_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);

-- Set by migration 0017 on an outbox that had published before: the first relay to
-- start adopts the existing topics its subscribers' templates reach, and deletes it.
CREATE TABLE {schema}.outbox_topic_adoption (
    requested_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);
