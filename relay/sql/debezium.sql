-- Debezium Outbox Event Router compatibility (run by `outbox-relay debezium attach`).
-- Apps keep inserting into their Debezium-style table (id, aggregatetype, aggregateid,
-- type, payload); a trigger copies each row, in the same transaction, into the relay's
-- outbox, so the relay's ordering guarantees apply. Apps that delete the row right
-- after inserting it (common with Debezium) lose nothing: the copy is made on INSERT.
-- {schema}: the relay's schema; {source}: the Debezium table; {function}/{trigger}: names.

-- name: attach
CREATE OR REPLACE FUNCTION {schema}.{function}() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    body jsonb;
BEGIN
    -- payload may be jsonb, json or text: keep JSON as is, wrap any other text.
    BEGIN
        body := to_jsonb(NEW.payload);
        IF jsonb_typeof(body) = 'string' THEN
            body := (NEW.payload)::text::jsonb;
        END IF;
    EXCEPTION WHEN others THEN
        body := to_jsonb((NEW.payload)::text);
    END;
    INSERT INTO {schema}.outbox (message_id, aggregate_type, aggregate_id, event_type, payload)
    VALUES (NEW.id::uuid, NEW.aggregatetype, NEW.aggregateid::text, NEW.type, body);
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS {trigger} ON {source};
CREATE TRIGGER {trigger} AFTER INSERT ON {source}
    FOR EACH ROW EXECUTE FUNCTION {schema}.{function}();
