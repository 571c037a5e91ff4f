-- Routing control (issue #33).

-- 1. A subscriber's key template, partition field and
-- header/envelope placements (relay/core/routing.py), as one object. NULL: the defaults
-- (key aggregate_id, the producer's partitioner, no placements), which every existing
-- subscriber keeps.
ALTER TABLE {schema}.outbox_subscribers
    ADD COLUMN routing jsonb CHECK (routing IS NULL OR jsonb_typeof(routing) = 'object');

-- 2. Debezium's partition placement (table.fields.additional.placement=<col>:partition):
-- the copy function records the column's value for the relay, as the router reads it.
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
    -- table.fields.additional.placement=<column>:partition (migration 0013).
    IF opts ->> 'partition' IS NOT NULL THEN
        descriptor := descriptor || jsonb_build_object('partition', r -> (opts ->> 'partition'));
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
