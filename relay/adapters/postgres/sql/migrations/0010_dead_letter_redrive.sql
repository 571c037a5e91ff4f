-- Dead-letter redrive (`outbox-relay dead-letters redrive`, relay/ops/redrive.py): which
-- dead letters were published again, and the one batch a redrive may have in flight.
-- redrive_batch numbers the redrive's Kafka transaction, whose committed consumer-group
-- offset carries the same number: after a crash, the batch Kafka committed is marked
-- redriven and any other in flight is cleared, so nothing is published twice.
ALTER TABLE {schema}.outbox_dead_letters
    ADD COLUMN IF NOT EXISTS redrive_batch bigint,
    ADD COLUMN IF NOT EXISTS redriven_at timestamptz,
    ADD COLUMN IF NOT EXISTS redrive_error text;
