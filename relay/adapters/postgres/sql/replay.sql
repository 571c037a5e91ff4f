-- `subscribers replay` (relay/ops/replay.py): the events of a range, and the replays on
-- the ledger (outbox_interventions, action 'replay'). Named queries; {schema} is a
-- quoted identifier. A replay is one 'start' entry (its arguments, under "args", and
-- the events of its range), a 'resume' entry per run that went on with it, and a
-- 'done' entry naming it ("of") once its last event is published.

-- name: replay_range
-- How many events of [start, end] (both included) the filters match (NULL: any).
SELECT pg_catalog.count(*)
  FROM {schema}.outbox o
 WHERE (o.transaction_id, o.position) >= (%(start_transaction_id)s::text::xid8, %(start_position)s)
   AND (o.transaction_id, o.position) <= (%(end_transaction_id)s::text::xid8, %(end_position)s)
   AND (%(aggregate_types)s::text[] IS NULL OR o.aggregate_type = ANY(%(aggregate_types)s::text[]))
   AND (%(event_types)s::text[] IS NULL OR o.event_type = ANY(%(event_types)s::text[]));

-- name: replay_events
-- What verify expects of a finished replay: the events of its range its filters match.
SELECT o.message_id, o.transaction_id::text::bigint, o.position, o.aggregate_type,
       o.event_type
  FROM {schema}.outbox o
 WHERE (o.transaction_id, o.position) >= (%(start_transaction_id)s::text::xid8, %(start_position)s)
   AND (o.transaction_id, o.position) <= (%(end_transaction_id)s::text::xid8, %(end_position)s)
   AND (%(aggregate_types)s::text[] IS NULL OR o.aggregate_type = ANY(%(aggregate_types)s::text[]))
   AND (%(event_types)s::text[] IS NULL OR o.event_type = ANY(%(event_types)s::text[]));

-- name: replays
-- The replays of a subscriber (by id: not a removed namesake's), oldest first, with
-- whether each is done.
SELECT i.id, i.params -> 'args', i.events,
       EXISTS (SELECT FROM {schema}.outbox_interventions d
                WHERE d.subscriber_id = i.subscriber_id
                  AND d.action = 'replay'
                  AND d.params ->> 'replay' = 'done'
                  AND d.params -> 'of' = pg_catalog.to_jsonb(i.id)) AS done
  FROM {schema}.outbox_interventions i
 WHERE i.subscriber_id = %(subscriber_id)s
   AND i.action = 'replay'
   AND i.params ->> 'replay' = 'start'
 ORDER BY i.id;

-- name: replay_lock
-- One replay per subscriber at a time (a session lock: released if the process dies),
-- so that two runs of one replay never both record its start. Its key too: any role may
-- take it, so a refusal names the holder.
SELECT k.key, pg_catalog.pg_try_advisory_lock(k.key)
  FROM (SELECT pg_catalog.hashtextextended('outbox-relay.replay.' || %(subscriber_id)s::text,
                                           0::bigint) AS key) AS k;

-- name: replay_unlock
SELECT pg_catalog.pg_advisory_unlock(
           pg_catalog.hashtextextended('outbox-relay.replay.' || %(subscriber_id)s::text,
                                       0::bigint));
