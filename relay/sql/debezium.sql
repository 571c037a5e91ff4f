-- Debezium Outbox Event Router compatibility (run by `outbox-relay debezium attach`).
-- Apps keep inserting into their Debezium-style table; a trigger copies each row, in the
-- same transaction, into the relay's outbox, so the relay's ordering guarantees apply.
-- Apps that delete the row right after inserting it (common with Debezium) lose nothing:
-- the copy is made on INSERT.
-- {schema}: the relay's schema; {source}: the Debezium table; {trigger}/{update_trigger}:
-- trigger names; {options}: the table's router options as JSON (relay/debezium.py).

-- name: columns
-- The source table's columns and their types (attach checks the options against them).
SELECT a.attname, a.attnotnull, t.typname
  FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
 WHERE a.attrelid = %(table)s::regclass AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY a.attnum;

-- name: function
-- One function serves every attached table: the trigger passes that table's options.
-- It must never fail the app's INSERT for a row Debezium accepts: every column is read
-- through row_to_json (a renamed or missing column reads as absent, any type reads as
-- JSON), nothing is cast that could fail, and what the Event Router would refuse is
-- recorded in the copy for the relay to apply its poison policy to, with the reason.
-- SECURITY DEFINER: the app's role needs no privilege on the relay's outbox.
CREATE OR REPLACE FUNCTION {schema}.outbox_from_debezium() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    opts jsonb := TG_ARGV[0]::jsonb;
    r json := row_to_json(NEW);
    payload_column text := opts ->> 'payload';
    payload_json json := r -> payload_column;
    payload text;
    route json := r -> (opts ->> 'route');
    event_key json := r -> (opts ->> 'key');
    event_id json := r -> (opts ->> 'id');
    descriptor jsonb;
    body jsonb;
    message uuid;
BEGIN
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
    INSERT INTO {schema}.outbox
        (message_id, aggregate_type, aggregate_id, event_type, payload, debezium)
    VALUES (message, coalesce(nullif(route #>> '{{}}', ''), '-'), coalesce(event_key #>> '{{}}', ''),
            coalesce(nullif(r ->> (opts ->> 'type'), ''), '-'), body, descriptor)
    ON CONFLICT (message_id) DO NOTHING;
    IF NOT FOUND THEN  -- the id is taken (another table, or a row re-inserted): keep both
        INSERT INTO {schema}.outbox
            (message_id, aggregate_type, aggregate_id, event_type, payload, debezium)
        VALUES (gen_random_uuid(), coalesce(nullif(route #>> '{{}}', ''), '-'),
                coalesce(event_key #>> '{{}}', ''),
                coalesce(nullif(r ->> (opts ->> 'type'), ''), '-'), body, descriptor);
    END IF;
    RETURN NULL;
END
$$;

-- name: attach
DROP TRIGGER IF EXISTS {trigger} ON {source};
CREATE TRIGGER {trigger} AFTER INSERT ON {source}
    FOR EACH ROW EXECUTE FUNCTION {schema}.outbox_from_debezium({options});
DROP TRIGGER IF EXISTS {update_trigger} ON {source};

-- name: attach_fatal_updates
-- table.op.invalid.behavior=fatal: an UPDATE is copied as an event that stops the relay.
CREATE TRIGGER {update_trigger} AFTER UPDATE ON {source}
    FOR EACH ROW EXECUTE FUNCTION {schema}.outbox_from_debezium({options});

-- name: drop_old_function
-- Before 0.2, attach made one function per table; the shared one replaces it.
DROP FUNCTION IF EXISTS {schema}.{old_function}();

-- name: publication
-- The Debezium connector's publication: does it list tables (it must, for a cut-over)?
SELECT p.puballtables,
       EXISTS (SELECT FROM pg_publication_rel r
                WHERE r.prpubid = p.oid AND r.prrelid = %(table)s::regclass)
  FROM pg_publication p WHERE p.pubname = %(publication)s;

-- name: cut_over
-- The cut-over from a running Debezium (deploy/README.md): in the transaction that
-- creates the trigger, wait for the app's writers in flight and hold new ones back for a
-- moment, then take the table out of Debezium's publication. Every row committed before
-- is Debezium's (its changes precede this commit in the WAL, where the table was still
-- published); every row committed after is copied to the relay, and Debezium's decoder,
-- reading past this commit, no longer sends it: none is lost, none is published twice.
LOCK TABLE {source} IN SHARE ROW EXCLUSIVE MODE;
ALTER PUBLICATION {publication} DROP TABLE {source};

-- name: wal_position
SELECT pg_current_wal_lsn()::text;
