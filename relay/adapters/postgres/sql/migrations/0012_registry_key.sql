-- The record key of an avro-registry subscriber (issue #32): 'string' (the
-- aggregate_id's UTF-8 bytes, as every other format) or 'avro-registry' (an Avro string
-- in the Confluent wire format, registered under <topic>-key). Existing subscribers
-- keep 'string'.
ALTER TABLE {schema}.outbox_subscribers
    ADD COLUMN key_format text NOT NULL DEFAULT 'string'
        CHECK (key_format IN ('string', 'avro-registry'));
