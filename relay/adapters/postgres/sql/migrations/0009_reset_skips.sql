-- Where the last reset forward jumped from (issue #28): the rows after it, up to the
-- generation's start, were skipped by that reset. status and verify count them apart,
-- so a reset that skipped events never looks like a clean, caught-up subscriber.
-- NULL: the generation began at creation, or a reset that skipped nothing. A rebase
-- (docs/design.md §6) leaves it untranslated: the range then lies after the start and
-- counts nothing, an undercount rather than a false alarm.
ALTER TABLE {schema}.outbox_checkpoints
    ADD COLUMN skipped_from_transaction_id xid8,
    ADD COLUMN skipped_from_position bigint;
