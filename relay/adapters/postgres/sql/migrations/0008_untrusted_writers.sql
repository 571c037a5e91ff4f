-- Untrusted writers and least-privileged roles (deploy/README.md, "Threat model: what a
-- writer role can and cannot do"): what a role that may write events, or no more than
-- log in, can no longer do to the relay or to other writers.

-- 1. Key-like columns are bounded, so a writer gets a clear error at INSERT instead of an
-- index or the relay failing later (docs/writing-events.md, "Limits"). In bytes: the
-- widest index entry (outbox_idempotency_key: type, id and key) then stays below the
-- B-tree limit (2704 bytes), so a row within the limits never fails. NOT VALID: rows
-- written before this migration are not scanned (no long lock on a large outbox, and no
-- failed upgrade for an old oversized row); every new row is checked.
ALTER TABLE {schema}.outbox
    ADD CONSTRAINT outbox_aggregate_type_length CHECK (octet_length(aggregate_type) <= 255) NOT VALID,
    ADD CONSTRAINT outbox_event_type_length CHECK (octet_length(event_type) <= 255) NOT VALID,
    ADD CONSTRAINT outbox_aggregate_id_length CHECK (octet_length(aggregate_id) <= 1024) NOT VALID,
    ADD CONSTRAINT outbox_idempotency_key_length
        CHECK (octet_length(idempotency_key) <= 1024) NOT VALID,
    ADD CONSTRAINT outbox_headers_size CHECK (octet_length(headers::text) <= 65536) NOT VALID;

-- 2. The ordering key and position are the outbox's, never a writer's: a key moved above
-- the cluster's ids looked like a restore and made the relay rebase every row. Only the
-- rebase changes them (it disables this trigger inside its own transaction).
CREATE FUNCTION {schema}.outbox_freeze_order_key() RETURNS trigger
LANGUAGE plpgsql AS $$
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

-- 3. The key-space check rebases only on evidence that the database moved: another
-- cluster (a new system identifier), or this cluster's ids below the ones the last
-- check saw or a checkpoint holds (pg_resetwal, or a dump restored into a clone). A
-- stored key above the cluster's ids without either was written by hand: it is
-- reported, and nothing is rewritten.
CREATE OR REPLACE FUNCTION {schema}.outbox_check_key_space(
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
    SELECT system_identifier INTO system FROM pg_control_system();
    -- One snapshot for all: a row it sees committed before it was taken, so its key is
    -- at most the snapshot's xmax (docs/design.md). Above it: written elsewhere.
    SELECT greatest(marker.high_water,
                    (SELECT max(transaction_id) FROM {schema}.outbox_checkpoints)),
           (SELECT max(transaction_id) FROM {schema}.outbox),
           pg_snapshot_xmax(pg_current_snapshot())
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
        detail := format('stored keys reach %s but this cluster is at %s', high, mine);
        SELECT id INTO key_space FROM {schema}.outbox_key_space;
    ELSIF system <> marker.system_identifier THEN
        action := 'continued';
        detail := format('cluster %s replaced %s; its ids (%s) are above every stored key (%s)',
                         system, marker.system_identifier, mine, high);
        UPDATE {schema}.outbox_key_space SET moved_high = high;
    ELSE
        action := 'unchanged';
        IF high > mine THEN
            detail := format('a stored key (%s) is above this cluster''s ids (%s), but the '
                             'cluster is the one that wrote the keys: not rebased', high, mine);
        END IF;
    END IF;
    UPDATE {schema}.outbox_key_space
       SET system_identifier = system, high_water = mine, checked_at = now();
END
$$;

-- The rebase waits at most lock_timeout for writers in flight (writers queue behind its
-- lock meanwhile): past it, the check fails and is retried, instead of stalling writers.
CREATE OR REPLACE FUNCTION {schema}.outbox_rebase_keys(marker {schema}.outbox_key_space)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET lock_timeout = '5s' AS $$
DECLARE
    copied_age integer;
    moved bigint := 0;
    old_row record;
    new_position bigint;
    next_space uuid := gen_random_uuid();
BEGIN
    -- Writers wait (briefly) and their rows in flight are decided before we look.
    LOCK TABLE {schema}.outbox IN SHARE ROW EXCLUSIVE MODE;
    LOCK TABLE {schema}.outbox_checkpoints, {schema}.outbox_dead_letters IN EXCLUSIVE MODE;
    SELECT min(age(o.xmin)) INTO copied_age
      FROM {schema}.outbox o, pg_current_snapshot() AS s
     WHERE o.transaction_id > pg_snapshot_xmax(s)
        OR o.position = (SELECT min(position) FROM {schema}.outbox);
    -- The one writer of the keys: in this transaction only (the lock above keeps every
    -- other session from writing meanwhile).
    ALTER TABLE {schema}.outbox DISABLE TRIGGER outbox_freeze_order_key;
    FOR old_row IN
        SELECT o.transaction_id, o.position FROM {schema}.outbox o
         WHERE age(o.xmin) >= copied_age
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
           version = c.version + 1, updated_at = now()
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
           rebased_at = now(), rebased_rows = moved;
    RETURN moved;
END
$$;

-- 4. Retention without DELETE on the outbox: the relay role may delete published rows
-- past the retention, and only those. The bound is read here, from the checkpoints,
-- once per batch (a reset that moves a checkpoint back stops the deletion there).
-- One batch per call: short transactions, so autovacuum keeps up. A stream's latest
-- version stays: the next event-sourced append checks that it exists.
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
           AND o.occurred_at < now() - make_interval(secs => older_than_s)
           AND (o.aggregate_version IS NULL OR EXISTS (
                 SELECT 1 FROM {schema}.outbox n
                  WHERE n.aggregate_type = o.aggregate_type AND n.aggregate_id = o.aggregate_id
                    AND n.aggregate_version = o.aggregate_version + 1))
         ORDER BY o.transaction_id, o.position
         LIMIT batch_size
    )
    DELETE FROM {schema}.outbox WHERE ctid IN (SELECT ctid FROM doomed);
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;

-- 5. Debezium-style tables copy their rows through one SECURITY DEFINER function. Its
-- options (topic, headers...) were trigger arguments, so any role able to create a
-- trigger (on a TEMP table of its own) could publish what it liked, where it liked. Now
-- they are read from this registry, which only the owner writes (`outbox-relay debezium
-- attach` / `detach`), keyed by the attached table (regclass: a dump and restore keeps
-- the entry with its table); a table not in it is refused.
CREATE TABLE {schema}.outbox_debezium_tables (
    source      regclass PRIMARY KEY,
    options     jsonb NOT NULL CHECK (jsonb_typeof(options) = 'object'),
    attached_at timestamptz NOT NULL DEFAULT now()
);

-- Tables attached before this migration: their options are their triggers' argument.
INSERT INTO {schema}.outbox_debezium_tables (source, options)
SELECT DISTINCT ON (t.tgrelid) t.tgrelid::regclass,
       convert_from(substring(t.tgargs FROM 1 FOR length(t.tgargs) - 1), 'UTF8')::jsonb
  FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
 WHERE p.proname = 'outbox_from_debezium' AND t.tgnargs = 1
   AND p.pronamespace = (SELECT c.relnamespace FROM pg_class c
                          WHERE c.oid = (SELECT k.tableoid FROM {schema}.outbox_key_space k))
 ORDER BY t.tgrelid, t.tgname;

-- One function serves every attached table. It must never fail the app's INSERT into an
-- attached table for a row Debezium accepts: every column is read through row_to_json (a
-- renamed or missing column reads as absent, any type reads as JSON), nothing is cast
-- that could fail, key-like values beyond the outbox's limits are cut (the copy keeps
-- them whole for the `debezium` format), and what the Event Router would refuse is
-- recorded in the copy for the relay to apply its poison policy to, with the reason.
-- SECURITY DEFINER: the app's role needs no privilege on the relay's outbox. EXECUTE is
-- nobody's but the owner's: only `debezium attach` creates triggers on it.
CREATE OR REPLACE FUNCTION {schema}.outbox_from_debezium() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    opts jsonb;
    r json := row_to_json(NEW);
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
    IF json_typeof(payload_json) IS DISTINCT FROM 'null' THEN
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
            body := to_jsonb(payload);
        END;
    ELSIF payload IS NOT NULL THEN
        body := to_jsonb(payload);
    END IF;
    descriptor := jsonb_build_object(
        'topic', CASE WHEN json_typeof(route) = 'string'
                      THEN replace(opts ->> 'replacement', '${{routedByValue}}', route #>> '{{}}') END,
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
        descriptor := descriptor || jsonb_build_object('headers',
            (SELECT jsonb_agg(jsonb_build_array(h ->> 1, r -> (h ->> 0)))
               FROM jsonb_array_elements(opts -> 'headers') h));
    END IF;
    IF opts -> 'envelope' <> '[]' THEN
        descriptor := descriptor || jsonb_build_object('envelope',
            (SELECT jsonb_agg(jsonb_build_array(e ->> 1, r -> (e ->> 0)))
               FROM jsonb_array_elements(opts -> 'envelope') e));
    END IF;
    -- A column that is gone reads as SQL NULL (a NULL value reads as JSON null).
    IF event_id IS NULL OR payload_json IS NULL OR route IS NULL
       OR jsonb_array_length(opts -> 'required') > 3 THEN
        descriptor := descriptor || jsonb_build_object('missing',
            (SELECT jsonb_agg(c) FROM jsonb_array_elements_text(opts -> 'required') c
              WHERE r -> c IS NULL));
    END IF;
    IF TG_OP = 'UPDATE' THEN
        -- table.op.invalid.behavior=fatal: Debezium stops on an UPDATE of its outbox;
        -- the relay stops the subscriber here, by its poison policy.
        descriptor := descriptor || jsonb_build_object('error', format(
            'the row with id %s of %I.%I was updated, and table.op.invalid.behavior is fatal',
            event_id, TG_TABLE_SCHEMA, TG_TABLE_NAME));
    END IF;
    IF json_typeof(event_id) = 'string' AND (event_id #>> '{{}}') ~*
            '^[0-9a-f]{{8}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{12}}$' THEN
        message := (event_id #>> '{{}}')::uuid;
    ELSE
        message := gen_random_uuid();
    END IF;
    -- Within the outbox's limits (in bytes; a character takes at most 4).
    routed := coalesce(nullif(route #>> '{{}}', ''), '-');
    keyed := coalesce(event_key #>> '{{}}', '');
    typed := coalesce(nullif(r ->> (opts ->> 'type'), ''), '-');
    IF octet_length(routed) > 255 THEN routed := left(routed, 63); END IF;
    IF octet_length(keyed) > 1024 THEN keyed := left(keyed, 256); END IF;
    IF octet_length(typed) > 255 THEN typed := left(typed, 63); END IF;
    INSERT INTO {schema}.outbox
        (message_id, aggregate_type, aggregate_id, event_type, payload, debezium)
    VALUES (message, routed, keyed, typed, body, descriptor)
    ON CONFLICT (message_id) DO NOTHING;
    IF NOT FOUND THEN  -- the id is taken (another table, or a row re-inserted): keep both
        INSERT INTO {schema}.outbox
            (message_id, aggregate_type, aggregate_id, event_type, payload, debezium)
        VALUES (gen_random_uuid(), routed, keyed, typed, body, descriptor);
    END IF;
    RETURN NULL;
END
$$;

-- SECURITY DEFINER: only the roles `outbox-relay grant` names may call them.
REVOKE EXECUTE ON FUNCTION {schema}.outbox_prune(double precision, integer),
    {schema}.outbox_from_debezium() FROM PUBLIC;
