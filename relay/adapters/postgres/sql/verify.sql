-- `verify` (relay/ops/verify.py, through relay/adapters/postgres/verify_queries.py):
-- what each subscriber part has published, and where the records it found outside
-- that lie. Named queries; {schema} is a quoted identifier.

-- name: published_events
-- What verify expects on the topics: each subscriber part's events up to its
-- checkpoint, matching the subscriber's filter, flagged when dead-lettered and when
-- redriven since (dead-letters redrive).
SELECT o.message_id, o.transaction_id::text::bigint, o.position, o.aggregate_type,
       o.event_type, d.message_id IS NOT NULL AS dead_lettered,
       d.redriven_at IS NOT NULL AS redriven, c.part
  FROM {schema}.outbox o
  JOIN {schema}.outbox_subscribers s ON s.name = %(name)s
  JOIN {schema}.outbox_checkpoints c
    ON c.subscriber = s.name
   AND c.part = CASE WHEN s.parts = 1 THEN 0 ELSE {schema}.outbox_part(o.aggregate_id, s.parts) END
  LEFT JOIN {schema}.outbox_dead_letters d
    ON d.subscriber = s.name AND d.transaction_id = o.transaction_id AND d.position = o.position
 WHERE (o.transaction_id, o.position) <= (c.transaction_id, c.position)
   AND (o.transaction_id, o.position) > (c.start_transaction_id, c.start_position)
   AND (%(aggregate_types)s::text[] IS NULL OR o.aggregate_type = ANY(%(aggregate_types)s::text[]))
   AND (%(event_types)s::text[] IS NULL OR o.event_type = ANY(%(event_types)s::text[]));

-- name: placed_messages
-- Where the records verify found outside a subscriber's expected range lie: for each
-- message id still in the outbox, whether it sorts at or before its part's start (a
-- record of an earlier generation, before a reset) or after its checkpoint (published
-- before the checkpoint moved: the crash window). Ids not returned were pruned.
SELECT o.message_id,
       CASE WHEN (o.transaction_id, o.position) <= (c.start_transaction_id, c.start_position)
                THEN 'before_start'
            WHEN (o.transaction_id, o.position) > (c.transaction_id, c.position)
                THEN 'ahead'
            ELSE 'filtered' END AS placed
  FROM {schema}.outbox o
  JOIN {schema}.outbox_subscribers s ON s.name = %(name)s
  JOIN {schema}.outbox_checkpoints c
    ON c.subscriber = s.name
   AND c.part = CASE WHEN s.parts = 1 THEN 0 ELSE {schema}.outbox_part(o.aggregate_id, s.parts) END
 WHERE o.message_id = ANY(%(ids)s::uuid[]);

-- name: part_starts
-- Parts whose generation starts after the beginning (created "now", or reset): verify
-- checks only what follows, and says so.
SELECT part, start_transaction_id::text::bigint, start_position FROM {schema}.outbox_checkpoints
 WHERE subscriber = %(name)s AND (start_transaction_id, start_position) > ('0'::xid8, 0)
 ORDER BY part;

-- name: event_keys
-- What a projection keys the expected events by (verify --through projection): each
-- id's type, aggregate id (the record's key) and one field of its payload.
SELECT o.message_id, o.aggregate_type, o.event_type, o.aggregate_id,
       o.payload ->> %(field)s::text
  FROM {schema}.outbox o
 WHERE o.message_id = ANY(%(ids)s::uuid[]);

-- name: message_ids_at
-- The events a projection's rows name by their (transaction_id, position).
SELECT o.transaction_id::text::bigint, o.position, o.message_id
  FROM {schema}.outbox o
  JOIN ROWS FROM (pg_catalog.unnest(%(transaction_ids)s::bigint[]),
                  pg_catalog.unnest(%(positions)s::bigint[])) AS k(tx, pos)
    ON o.transaction_id = k.tx::text::xid8 AND o.position = k.pos;
