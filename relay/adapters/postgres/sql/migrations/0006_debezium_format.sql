-- Debezium Outbox Event Router compatibility (docs: deploy/README.md, "Coming from
-- Debezium's Outbox Event Router").
-- Rows that `outbox-relay debezium attach` copies from a Debezium-style table carry what
-- the Event Router would have made of them (routed topic, typed key and id, the payload
-- as the connector sees it, header and envelope fields, converters) in `debezium`; the
-- `debezium` value format publishes exactly that. NULL for every other row, so adding
-- it rewrites nothing.
ALTER TABLE {schema}.outbox ADD COLUMN debezium jsonb;

ALTER TABLE {schema}.outbox_subscribers
    DROP CONSTRAINT outbox_subscribers_value_format_check,
    ADD CONSTRAINT outbox_subscribers_value_format_check
        CHECK (value_format IN ('avro', 'json', 'debezium'));
