-- Dead letters, listed and redriven (relay/ops/redrive.py). {schema} is a quoted identifier.

-- name: list_dead_letters
-- A subscriber's dead letters in publication order, with what is left of their event
-- (NULL when prune deleted the row).
SELECT d.part, d.transaction_id::text::bigint AS transaction_id, d.position, d.message_id,
       d.topic, d.error, d.decided_at, d.redriven_at, d.redrive_error,
       o.aggregate_type, o.aggregate_id, o.event_type
  FROM {schema}.outbox_dead_letters d
  LEFT JOIN {schema}.outbox o
    ON o.transaction_id = d.transaction_id AND o.position = d.position
 WHERE d.subscriber = %(name)s AND (%(all)s OR d.redriven_at IS NULL)
 ORDER BY d.transaction_id, d.position;

-- name: redrive_candidates
-- The next dead letters to redrive, in publication order, with their events: only those
-- the live relay has checkpointed past (its transaction with their dead letters is
-- committed, and so is everything before them in their part). NULL event columns: the
-- row was pruned.
SELECT d.part, d.message_id,
       o.transaction_id::text::bigint AS transaction_id, o.position, o.message_id,
       o.aggregate_type, o.aggregate_id, o.aggregate_version, o.event_type, o.payload,
       o.headers,
       least(greatest(o.occurred_at, '0001-01-02 00:00+00'), '9999-12-30 00:00+00'),
       0, o.debezium,
       d.transaction_id::text::bigint AS dead_transaction_id, d.position AS dead_position
  FROM {schema}.outbox_dead_letters d
  JOIN {schema}.outbox_checkpoints c ON c.subscriber = d.subscriber AND c.part = d.part
  LEFT JOIN {schema}.outbox o
    ON o.transaction_id = d.transaction_id AND o.position = d.position
 WHERE d.subscriber = %(name)s AND d.redriven_at IS NULL
   AND (d.transaction_id, d.position) > (%(after_tx)s::text::xid8, %(after_pos)s)
   AND (d.transaction_id, d.position) <= (c.transaction_id, c.position)
 ORDER BY d.transaction_id, d.position
 LIMIT %(limit)s;

-- name: redrive_settle
-- After a crash: the batch Kafka committed (its number is the redrive group's offset)
-- is redriven; any other batch in flight was not committed, and is cleared.
WITH done AS (
    UPDATE {schema}.outbox_dead_letters
       SET redriven_at = pg_catalog.now(), redrive_error = NULL
     WHERE subscriber = %(name)s AND redriven_at IS NULL AND redrive_batch = %(committed)s
    RETURNING 1
), cleared AS (
    UPDATE {schema}.outbox_dead_letters SET redrive_batch = NULL
     WHERE subscriber = %(name)s AND redriven_at IS NULL AND redrive_batch IS NOT NULL
       AND redrive_batch <> %(committed)s
    RETURNING 1
)
SELECT (SELECT pg_catalog.count(*) FROM done),
       greatest(%(committed)s,
                (SELECT pg_catalog.max(redrive_batch) FROM {schema}.outbox_dead_letters
                  WHERE subscriber = %(name)s AND redriven_at IS NOT NULL));

-- name: redrive_begin
-- The dead letters of the batch about to be published (before its Kafka transaction).
UPDATE {schema}.outbox_dead_letters SET redrive_batch = %(batch)s
 WHERE subscriber = %(name)s AND redriven_at IS NULL AND message_id = ANY(%(ids)s::uuid[]);

-- name: redrive_abandon
-- The batch's transaction was aborted: its dead letters are no longer in flight.
UPDATE {schema}.outbox_dead_letters SET redrive_batch = NULL
 WHERE subscriber = %(name)s AND redriven_at IS NULL AND redrive_batch = %(batch)s;

-- name: redrive_done
-- The batch's Kafka transaction committed.
UPDATE {schema}.outbox_dead_letters SET redriven_at = pg_catalog.now(), redrive_error = NULL
 WHERE subscriber = %(name)s AND redriven_at IS NULL AND redrive_batch = %(batch)s;

-- name: redrive_refused
-- Why a redrive left this dead letter where it is.
UPDATE {schema}.outbox_dead_letters SET redrive_error = %(error)s
 WHERE subscriber = %(name)s AND redriven_at IS NULL AND message_id = %(message_id)s;

-- name: redrive_lock
-- One redrive per subscriber at a time (a session lock: released if the process dies).
-- Its key too: any role may take it, so a refusal names the holder.
SELECT k.key, pg_catalog.pg_try_advisory_lock(k.key)
  FROM (SELECT pg_catalog.hashtextextended('outbox-relay.redrive.' || %(name)s::text, 0::bigint)
                   AS key) AS k;

-- name: redrive_unlock
SELECT pg_catalog.pg_advisory_unlock(
           pg_catalog.hashtextextended('outbox-relay.redrive.' || %(name)s::text, 0::bigint));

-- name: pending_dead_letters_before
-- `dead-letters prune --pending-older-than`'s preview: the dead letters not yet redriven,
-- decided more than %(older_than)s seconds ago, and not in a redrive's flight.
SELECT d.message_id FROM {schema}.outbox_dead_letters d
 WHERE d.subscriber = %(name)s AND d.redriven_at IS NULL AND d.redrive_batch IS NULL
   AND d.decided_at < pg_catalog.now() - pg_catalog.make_interval(secs => %(older_than)s::float8)
 ORDER BY d.transaction_id, d.position;

-- name: lock_pending_dead_letter_ids
-- Of the previewed dead letters, those still not redriven and not in flight, locked
-- until the transaction deletes them (a redrive or a retention pass meanwhile keeps its
-- own): how many the ledger entry counts.
SELECT d.message_id FROM {schema}.outbox_dead_letters d
 WHERE d.subscriber = %(name)s AND d.redriven_at IS NULL AND d.redrive_batch IS NULL
   AND d.message_id = ANY(%(ids)s::uuid[])
   FOR UPDATE;

-- name: prune_pending_dead_letter_ids
-- Deletes the locked dead letters, each then on the record as skipped by the
-- operator's prune (verify and status read outbox_skipped; migration 0019).
WITH gone AS (
    DELETE FROM {schema}.outbox_dead_letters d
     WHERE d.subscriber = %(name)s AND d.message_id = ANY(%(ids)s::uuid[])
    RETURNING d.part, d.message_id
)
INSERT INTO {schema}.outbox_skipped (intervention, subscriber_id, part, message_id, events)
SELECT %(intervention)s, %(subscriber_id)s, g.part, g.message_id, 1 FROM gone g;
