-- Named queries. Each starts with "-- name: <name>"; {schema} is substituted with a
-- quoted identifier, %(...)s are bind parameters.

-- name: append_event
INSERT INTO {schema}.outbox
    (aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, idempotency_key)
VALUES (%(aggregate_type)s, %(aggregate_id)s, %(aggregate_version)s, %(event_type)s,
        %(payload)s, %(headers)s, %(idempotency_key)s)
RETURNING message_id;

-- name: append_event_idempotent
-- Returns the new message id, or nothing when the key already exists (then the
-- caller looks it up: a row committed by a concurrent writer while we waited on
-- the unique index is invisible to this statement's snapshot).
INSERT INTO {schema}.outbox
    (aggregate_type, aggregate_id, event_type, payload, headers, idempotency_key)
VALUES (%(aggregate_type)s, %(aggregate_id)s, %(event_type)s,
        %(payload)s, %(headers)s, %(idempotency_key)s)
ON CONFLICT (aggregate_type, aggregate_id, idempotency_key) WHERE idempotency_key IS NOT NULL
DO NOTHING
RETURNING message_id;

-- name: find_by_idempotency_key
SELECT message_id FROM {schema}.outbox
 WHERE aggregate_type = %(aggregate_type)s
   AND aggregate_id = %(aggregate_id)s
   AND idempotency_key = %(idempotency_key)s;

-- name: stream_version
SELECT coalesce(max(aggregate_version), 0) FROM {schema}.outbox
 WHERE aggregate_type = %(aggregate_type)s
   AND aggregate_id = %(aggregate_id)s
   AND aggregate_version IS NOT NULL;

-- name: fetch_batch
-- The heart of the relay (seed 002): rows of transactions whose fate is decided
-- (below the oldest running xid) after the checkpoint, in (transaction_id, position)
-- order. A keyset range scan on the primary key.
SELECT transaction_id::text::bigint AS transaction_id, position, message_id,
       aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers,
       occurred_at
  FROM {schema}.outbox
 WHERE (transaction_id, position) > (%(transaction_id)s::text::xid8, %(position)s)
   AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
 ORDER BY transaction_id, position
 LIMIT %(limit)s;

-- name: horizon
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint;

-- name: insert_subscriber
INSERT INTO {schema}.outbox_subscribers (name, aggregate_types, event_types, topic, value_format)
VALUES (%(name)s, %(aggregate_types)s, %(event_types)s, %(topic)s, %(value_format)s)
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: update_subscriber
UPDATE {schema}.outbox_subscribers
   SET aggregate_types = %(aggregate_types)s, event_types = %(event_types)s,
       topic = %(topic)s, value_format = %(value_format)s, updated_at = now()
 WHERE name = %(name)s;

-- name: insert_checkpoint
-- start 'beginning': before every row; 'now': after every transaction already decided.
INSERT INTO {schema}.outbox_checkpoints (subscriber, part, transaction_id, position)
VALUES (%(name)s, 0,
        CASE WHEN %(start)s = 'now' THEN pg_snapshot_xmin(pg_current_snapshot()) ELSE '0'::xid8 END,
        0)
ON CONFLICT (subscriber, part) DO NOTHING;

-- name: list_subscribers
SELECT s.name, s.aggregate_types, s.event_types, s.topic, s.value_format, s.paused,
       c.transaction_id::text::bigint AS transaction_id, c.position, c.version, c.updated_at
  FROM {schema}.outbox_subscribers s
  JOIN {schema}.outbox_checkpoints c ON c.subscriber = s.name AND c.part = 0
 ORDER BY s.name;

-- name: get_subscriber
SELECT s.name, s.aggregate_types, s.event_types, s.topic, s.value_format, s.paused,
       c.transaction_id::text::bigint AS transaction_id, c.position, c.version, c.updated_at
  FROM {schema}.outbox_subscribers s
  JOIN {schema}.outbox_checkpoints c ON c.subscriber = s.name AND c.part = 0
 WHERE s.name = %(name)s;

-- name: advance_checkpoint
-- Compare-and-set: only the holder of the current version may move the checkpoint,
-- and only forwards.
UPDATE {schema}.outbox_checkpoints
   SET transaction_id = %(transaction_id)s::text::xid8, position = %(position)s,
       version = version + 1, updated_at = now()
 WHERE subscriber = %(name)s AND part = 0 AND version = %(version)s
   AND (transaction_id, position) <= (%(transaction_id)s::text::xid8, %(position)s)
RETURNING version;

-- name: set_paused
-- Bumps the checkpoint version so a running relay notices at its next checkpoint.
WITH s AS (
    UPDATE {schema}.outbox_subscribers SET paused = %(paused)s, updated_at = now()
     WHERE name = %(name)s RETURNING name
)
UPDATE {schema}.outbox_checkpoints c SET version = version + 1
  FROM s WHERE c.subscriber = s.name
RETURNING c.subscriber;

-- name: reset_checkpoint
UPDATE {schema}.outbox_checkpoints
   SET transaction_id = CASE %(to)s
           WHEN 'beginning' THEN '0'::xid8
           WHEN 'now' THEN pg_snapshot_xmin(pg_current_snapshot())
           ELSE %(transaction_id)s::text::xid8 END,
       position = CASE WHEN %(to)s = 'position' THEN %(position)s ELSE 0 END,
       version = version + 1, updated_at = now()
 WHERE subscriber = %(name)s
RETURNING subscriber;

-- name: delete_subscriber
DELETE FROM {schema}.outbox_subscribers WHERE name = %(name)s RETURNING name;

-- name: pending_events
-- Rows after the checkpoint, committed or not yet decided: the subscriber's lag.
SELECT count(*) FROM {schema}.outbox
 WHERE (transaction_id, position) > (%(transaction_id)s::text::xid8, %(position)s);
