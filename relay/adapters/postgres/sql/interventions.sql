-- Operators' interventions (migration 0019; relay/ops/interventions.py): the ledger, the
-- skip list, and what a reset or a skip would skip or republish. Named queries, as in
-- queries.sql (loaded with it); {schema} is a quoted identifier.

-- name: lock_parts
-- A subscriber's parts as an intervention finds them, locked until its transaction
-- ends: a relay's checkpoint advance waits, so what is counted is what is changed.
SELECT c.part, c.transaction_id::text::bigint AS transaction_id, c.position,
       c.halted_error,
       CASE WHEN c.halted_error IS NOT NULL THEN c.halted_message_id END AS halted_message_id
  FROM {schema}.outbox_checkpoints c
 WHERE c.subscriber = %(name)s
 ORDER BY c.part
   FOR UPDATE;

-- name: count_moved_events
-- What a reset would do to each part (relay/core/interventions.py, PartMove): the
-- events of the part in its range (after, upto] (from its checkpoint to the target, or
-- back) that the subscriber's filters match, but those the operator skipped already
-- (`subscribers skip`), counted per part. One scan of the outbox over every range
-- (low, high], each row's part computed once and joined to its part's range: not one
-- scan per part, each reading every part's rows.
WITH r AS (
    SELECT u.part, u.after_transaction_id::text::xid8 AS after_transaction_id,
           u.after_position, u.upto_transaction_id::text::xid8 AS upto_transaction_id,
           u.upto_position
      FROM ROWS FROM (pg_catalog.unnest(%(part)s::integer[]),
                      pg_catalog.unnest(%(after_transaction_id)s::bigint[]),
                      pg_catalog.unnest(%(after_position)s::bigint[]),
                      pg_catalog.unnest(%(upto_transaction_id)s::bigint[]),
                      pg_catalog.unnest(%(upto_position)s::bigint[]))
           AS u (part, after_transaction_id, after_position, upto_transaction_id, upto_position)
), e AS (
    SELECT o.transaction_id, o.position,
           CASE WHEN %(parts)s = 1 THEN 0
                ELSE {schema}.outbox_part(o.aggregate_id, %(parts)s::integer) END AS part
      FROM {schema}.outbox o
     WHERE (o.transaction_id, o.position) > (%(low_transaction_id)s::text::xid8, %(low_position)s)
       AND (o.transaction_id, o.position)
           <= (%(high_transaction_id)s::text::xid8, %(high_position)s)
       AND (%(aggregate_types)s::text[] IS NULL
            OR o.aggregate_type = ANY(%(aggregate_types)s::text[]))
       AND (%(event_types)s::text[] IS NULL OR o.event_type = ANY(%(event_types)s::text[]))
       AND NOT EXISTS (SELECT FROM {schema}.outbox_skipped k
                        WHERE k.subscriber_id = %(subscriber_id)s
                          AND k.message_id = o.message_id)
)
SELECT r.part, pg_catalog.count(*)
  FROM e
  JOIN r ON r.part = e.part
 WHERE (e.transaction_id, e.position) > (r.after_transaction_id, r.after_position)
   AND (e.transaction_id, e.position) <= (r.upto_transaction_id, r.upto_position)
 GROUP BY r.part;

-- name: skip_targets
-- What `subscribers skip` checks of each event asked for: whether the outbox has it, its
-- key and part, whether the subscriber's filters take it, whether its part has published
-- it (at or before the checkpoint), whether it is skipped already, and whether its part
-- is halted on it.
SELECT i.message_id, o.transaction_id::text::bigint AS transaction_id, o.position,
       o.aggregate_type, o.event_type, c.part,
       c.transaction_id::text::bigint AS checkpoint_transaction_id,
       c.position AS checkpoint_position,
       (s.aggregate_types IS NULL OR o.aggregate_type = ANY(s.aggregate_types))
           AND (s.event_types IS NULL OR o.event_type = ANY(s.event_types)) AS matches,
       k.intervention AS skipped_by,
       c.halted_error IS NOT NULL AND c.halted_message_id = i.message_id AS halted_on_it
  FROM pg_catalog.unnest(%(ids)s::uuid[]) AS i (message_id)
  JOIN {schema}.outbox_subscribers s ON s.name = %(name)s
  LEFT JOIN {schema}.outbox o ON o.message_id = i.message_id
  LEFT JOIN {schema}.outbox_checkpoints c
    ON c.subscriber = s.name
   AND c.part = CASE WHEN s.parts = 1 THEN 0
                     ELSE {schema}.outbox_part(o.aggregate_id, s.parts) END
  LEFT JOIN {schema}.outbox_skipped k
    ON k.subscriber_id = s.id AND k.message_id = i.message_id;

-- name: record_intervention
-- One entry of the ledger; who (db_role) and when (recorded_at) are the database's.
INSERT INTO {schema}.outbox_interventions
    (subscriber, subscriber_id, action, os_user, host, params, events)
VALUES (%(subscriber)s, %(subscriber_id)s, %(action)s, %(os_user)s, %(host)s, %(params)s,
        %(events)s)
RETURNING id;

-- name: record_skipped_event
INSERT INTO {schema}.outbox_skipped (intervention, subscriber_id, part, message_id, events)
VALUES (%(intervention)s, %(subscriber_id)s, %(part)s, %(message_id)s, 1);

-- name: record_skipped_range
INSERT INTO {schema}.outbox_skipped
    (intervention, subscriber_id, part, after_transaction_id, after_position,
     upto_transaction_id, upto_position, events)
VALUES (%(intervention)s, %(subscriber_id)s, %(part)s, %(after_transaction_id)s::text::xid8,
        %(after_position)s, %(upto_transaction_id)s::text::xid8, %(upto_position)s, %(events)s);

-- name: skip_on_part
-- The part's skip list grows by the events; a halt on one of them is cleared (the part
-- resumes: `subscribers skip` of the poison event). Bumps the version, so a busy relay
-- reloads the list at its next checkpoint and an idle one at its next poll.
UPDATE {schema}.outbox_checkpoints
   SET skip_message_ids = pg_catalog.array_cat(skip_message_ids, %(ids)s::uuid[]),
       halted_at = CASE WHEN halted_message_id = ANY(%(ids)s::uuid[]) THEN NULL ELSE halted_at END,
       halted_error = CASE WHEN halted_message_id = ANY(%(ids)s::uuid[]) THEN NULL
                           ELSE halted_error END,
       halted_message_id = CASE WHEN halted_message_id = ANY(%(ids)s::uuid[]) THEN NULL
                                ELSE halted_message_id END,
       version = version + 1
 WHERE subscriber = %(name)s AND part = %(part)s;

-- name: ledger
-- A subscriber's interventions, by name (every subscriber of that name, removed ones
-- too), oldest first.
SELECT id, subscriber, subscriber_id, action, recorded_at, db_role, os_user, host, params,
       events
  FROM {schema}.outbox_interventions
 WHERE subscriber = %(name)s
 ORDER BY id;

-- name: operator_skips
-- What the operator skipped of a subscriber (by its id: not a removed namesake's), per
-- entry and part, with the entry.
SELECT i.id, i.subscriber, i.subscriber_id, i.action, i.recorded_at, i.db_role, i.os_user,
       i.host, i.params, i.events, k.part, k.events AS part_events, k.message_id,
       k.after_transaction_id::text::bigint, k.after_position,
       k.upto_transaction_id::text::bigint, k.upto_position
  FROM {schema}.outbox_skipped k
  JOIN {schema}.outbox_interventions i ON i.id = k.intervention
 WHERE k.subscriber_id = %(subscriber_id)s
 ORDER BY i.id, k.part, k.message_id;
