-- The avro-registry value format (issue #32): Avro in the Confluent wire format with
-- schema ids from a schema registry, registered under the subscriber's subject naming
-- strategy. Existing subscribers keep 'topic', which only avro-registry reads.
ALTER TABLE {schema}.outbox_subscribers
    DROP CONSTRAINT outbox_subscribers_value_format_check,
    ADD CONSTRAINT outbox_subscribers_value_format_check
        CHECK (value_format IN ('avro', 'json', 'debezium', 'avro-registry')),
    ADD COLUMN subject_strategy text NOT NULL DEFAULT 'topic'
        CHECK (subject_strategy IN ('topic', 'record', 'topic-record'));
