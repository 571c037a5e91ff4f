-- Routing control (issue #33): a subscriber's key template, partition field and
-- header/envelope placements (relay/routing.py), as one object. NULL: the defaults
-- (key aggregate_id, the producer's partitioner, no placements), which every existing
-- subscriber keeps.
ALTER TABLE {schema}.outbox_subscribers
    ADD COLUMN routing jsonb CHECK (routing IS NULL OR jsonb_typeof(routing) = 'object');
