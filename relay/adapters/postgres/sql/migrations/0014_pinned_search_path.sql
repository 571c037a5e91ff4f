-- The relay's code never resolves to a function outside pg_catalog and its own schema
-- (issue #47, the CVE-2018-1058 pattern; docs/design.md §2, "Names").
--
-- Every migration now runs with search_path = pg_catalog, pg_temp, and the relay's
-- connections are pinned the same way. But a stored definition binds its calls when it
-- is created, under the search_path of the session that created it: an install migrated
-- while a role that may CREATE in a schema on the owner's path (PUBLIC in `public`,
-- before Postgres 15) had put a better-matching overload there keeps calling it. The
-- order-key trigger's WHEN clause took currval('...') with an untyped literal, so a
-- public.currval(text) ran inside every writer's INSERT, as that writer; outbox_part
-- hashed with an integer seed, so a public.hashtextextended(text, integer) ran in every
-- poll and in every insert that maintains a part index. This migration creates every
-- stored definition that calls a function again, with the calls qualified and typed:
--
-- 1. The order-key trigger, its WHEN clause and its function.
-- 2. outbox_part: inlined into queries and part-index predicates, so no SET search_path
--    (that would stop the inlining); its body is bound now, qualified and exactly typed.
--    Same result for every input, so the part indexes stay valid.
-- 3. The functions that run in a writer's session without SECURITY DEFINER: a writer's
--    own path may list a schema others create in, before pg_catalog even. The
--    stream-order trigger (a row of every stream append) qualifies its operators: a SET
--    search_path would cost about 4 us a call. The frozen-key trigger (it only refuses)
--    gets SET search_path = pg_catalog, pg_temp. The SECURITY DEFINER functions had a
--    pinned path already; their bodies are qualified too.
-- 4. The column defaults that call functions (the ordering key's among them).
--
-- The CHECK constraints stay: each calls a function with arguments of its exact type,
-- which Postgres finds in pg_catalog first unless the creating session's path named
-- pg_catalog after another schema; making them again would scan the outbox under an
-- exclusive lock. Writers wait for this migration's lock on the outbox, briefly.

-- 1. The order-key trigger.
CREATE OR REPLACE FUNCTION {schema}.outbox_assign_order_key() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.transaction_id := greatest(pg_catalog.pg_current_xact_id(),
                                   pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot()));
    NEW.position := pg_catalog.nextval(
        pg_catalog.format('%I.outbox_position_seq', TG_TABLE_SCHEMA)::regclass);
    RETURN NEW;
END
$$;

CREATE OR REPLACE TRIGGER outbox_assign_order_key
    BEFORE INSERT ON {schema}.outbox
    FOR EACH ROW
    WHEN (NEW.transaction_id IS DISTINCT FROM
              greatest(pg_catalog.pg_current_xact_id(),
                       pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot()))
          OR NEW.position IS DISTINCT FROM
              pg_catalog.currval('{schema}.outbox_position_seq'::regclass))
    EXECUTE FUNCTION {schema}.outbox_assign_order_key();

-- 2. The part function.
CREATE OR REPLACE FUNCTION {schema}.outbox_part(aggregate_id text, parts integer) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN ((pg_catalog.hashtextextended(aggregate_id, 0::bigint) & 9223372036854775807::bigint)
        % parts::bigint)::integer;

-- 3. Functions that run in a writer's session, and the SECURITY DEFINER ones.
CREATE OR REPLACE FUNCTION {schema}.outbox_check_stream_order() RETURNS trigger
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

CREATE OR REPLACE FUNCTION {schema}.outbox_freeze_order_key() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'the outbox''s transaction_id and position cannot be changed (row %, %)',
        OLD.transaction_id, OLD.position
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'the outbox assigns both; write a new event instead';
END
$$;

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

CREATE OR REPLACE FUNCTION {schema}.outbox_rebase_keys(marker {schema}.outbox_key_space)
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

CREATE OR REPLACE FUNCTION {schema}.outbox_translate_key(
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

CREATE OR REPLACE FUNCTION {schema}.outbox_prune(older_than_s double precision, batch_size integer)
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
           AND o.occurred_at < pg_catalog.now() - pg_catalog.make_interval(secs => older_than_s)
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

CREATE OR REPLACE FUNCTION {schema}.outbox_from_debezium() RETURNS trigger
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

-- 4. Column defaults.
ALTER TABLE {schema}.outbox
    ALTER COLUMN transaction_id
        SET DEFAULT greatest(pg_catalog.pg_current_xact_id(),
                             pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())),
    ALTER COLUMN message_id SET DEFAULT pg_catalog.gen_random_uuid(),
    ALTER COLUMN occurred_at SET DEFAULT pg_catalog.now();
ALTER TABLE {schema}.outbox_subscribers
    ALTER COLUMN created_at SET DEFAULT pg_catalog.now(),
    ALTER COLUMN updated_at SET DEFAULT pg_catalog.now(),
    ALTER COLUMN id SET DEFAULT pg_catalog.gen_random_uuid();
ALTER TABLE {schema}.outbox_relay_sessions
    ALTER COLUMN id SET DEFAULT pg_catalog.gen_random_uuid(),
    ALTER COLUMN started_at SET DEFAULT pg_catalog.now(),
    ALTER COLUMN heartbeat_at SET DEFAULT pg_catalog.now();
ALTER TABLE {schema}.outbox_checkpoints
    ALTER COLUMN updated_at SET DEFAULT pg_catalog.now(),
    ALTER COLUMN generation SET DEFAULT pg_catalog.gen_random_uuid();
ALTER TABLE {schema}.outbox_dead_letters
    ALTER COLUMN decided_at SET DEFAULT pg_catalog.now();
ALTER TABLE {schema}.outbox_key_space
    ALTER COLUMN id SET DEFAULT pg_catalog.gen_random_uuid(),
    ALTER COLUMN checked_at SET DEFAULT pg_catalog.now();
ALTER TABLE {schema}.outbox_debezium_tables
    ALTER COLUMN attached_at SET DEFAULT pg_catalog.now();
ALTER TABLE {schema}.outbox_relay_migrations
    ALTER COLUMN applied_at SET DEFAULT pg_catalog.now();
