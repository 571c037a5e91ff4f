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
-- the unique index is invisible to this statement's snapshot). No conflict target:
-- the key's unique index is (aggregate_type, aggregate_id, idempotency_key) before
-- migration 0015 and has the writer too after it, and this statement runs on both.
INSERT INTO {schema}.outbox
    (aggregate_type, aggregate_id, event_type, payload, headers, idempotency_key)
VALUES (%(aggregate_type)s, %(aggregate_id)s, %(event_type)s,
        %(payload)s, %(headers)s, %(idempotency_key)s)
ON CONFLICT DO NOTHING
RETURNING message_id;

-- name: keys_per_writer
-- Whether the outbox scopes keys per writer (migration 0015): asked only when a key
-- already exists, so an app may run this version before the migration.
SELECT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                WHERE a.attrelid = pg_catalog.to_regclass(
                                       pg_catalog.format('%%I.outbox', %(schema)s::text))
                  AND a.attname = 'writer' AND NOT a.attisdropped);

-- name: find_own_by_idempotency_key
-- The caller's own event with this key, and whether it is the event appended now
-- (headers aside: a retry carries a new trace context).
SELECT message_id, event_type = %(event_type)s AND payload = %(payload)s
  FROM {schema}.outbox_own_keys
 WHERE aggregate_type = %(aggregate_type)s
   AND aggregate_id = %(aggregate_id)s
   AND idempotency_key = %(idempotency_key)s;

-- name: find_by_idempotency_key
-- Before migration 0015: the one event with this key, whoever wrote it.
SELECT message_id FROM {schema}.outbox
 WHERE aggregate_type = %(aggregate_type)s
   AND aggregate_id = %(aggregate_id)s
   AND idempotency_key = %(idempotency_key)s;

-- name: newest_decided
-- The commit probe (relay/adapters/postgres/probe.py): the newest row below the horizon (a backward
-- range scan of the primary key that stops at its first visible row), and whether
-- committed rows wait at or above the horizon while no transaction runs. Their key is
-- then an xid not handed out yet (docs/design.md, "Ordering"): taking one releases them.
-- Both are backward scans that stop at the newest visible row. Not EXISTS: the planner
-- guesses that a third of the table qualifies and serves it with a sequential scan,
-- which reads the whole table whenever nothing does, as on every idle probe.
SELECT newest.transaction_id, newest.position,
       pg_catalog.pg_snapshot_xmin(s) = pg_catalog.pg_snapshot_xmax(s)
       AND (SELECT w.transaction_id FROM {schema}.outbox w
             ORDER BY w.transaction_id DESC, w.position DESC LIMIT 1) >= pg_catalog.pg_snapshot_xmin(s)
  FROM pg_catalog.pg_current_snapshot() AS s
  LEFT JOIN LATERAL (
       SELECT o.transaction_id, o.position
         FROM {schema}.outbox o
        WHERE o.transaction_id < pg_catalog.pg_snapshot_xmin(s)
        ORDER BY o.transaction_id DESC, o.position DESC
        LIMIT 1) AS newest ON true;

-- name: decided_types_between
-- The commit probe (relay/adapters/postgres/probe.py): the aggregate types of the rows decided since its
-- last look, keys in (after, upto], so that it wakes only the parts that can have rows
-- of them. A forward range scan of the primary key over at most %(limit)s rows; it says
-- how many it read (as many as the limit: there may be other types, wake every part).
SELECT pg_catalog.array_agg(DISTINCT r.aggregate_type), pg_catalog.count(*)
  FROM (SELECT o.aggregate_type
          FROM {schema}.outbox o
         WHERE (o.transaction_id, o.position)
               > (%(after_transaction_id)s::text::xid8, %(after_position)s)
           AND (o.transaction_id, o.position)
               <= (%(upto_transaction_id)s::text::xid8, %(upto_position)s)
         ORDER BY o.transaction_id, o.position
         LIMIT %(limit)s) AS r;

-- name: insert_subscriber
INSERT INTO {schema}.outbox_subscribers
    (name, aggregate_types, event_types, topic, value_format, parts, on_poison, dead_letter_topic)
VALUES (%(name)s, %(aggregate_types)s, %(event_types)s, %(topic)s, %(value_format)s,
        %(parts)s, %(on_poison)s, %(dead_letter_topic)s)
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: update_subscriber
-- The part count is fixed at creation (changing it would move keys between parts
-- whose checkpoints differ), so it is only compared, never updated.
-- Bumps the checkpoint versions, so busy workers reload the definition at their next
-- checkpoint write rather than only when idle.
WITH s AS (
    UPDATE {schema}.outbox_subscribers
       SET aggregate_types = %(aggregate_types)s, event_types = %(event_types)s,
           topic = %(topic)s, value_format = %(value_format)s, on_poison = %(on_poison)s,
           dead_letter_topic = %(dead_letter_topic)s, updated_at = pg_catalog.now()
     WHERE name = %(name)s
    RETURNING name, parts
), bumped AS (
    UPDATE {schema}.outbox_checkpoints c SET version = version + 1
      FROM s WHERE c.subscriber = s.name
)
SELECT parts FROM s;

-- name: lock_subscriber
-- OutboxStore.replace: the definition read after this lock is the one the change
-- replaces (a concurrent change waits, or is seen).
SELECT name FROM {schema}.outbox_subscribers WHERE name = %(name)s FOR UPDATE;

-- name: set_subject_strategy
-- Apart from insert_subscriber and update_subscriber, which a relay runs on schemas
-- before 0011 too (rolling deploys): only avro-registry subscribers, which need 0011
-- anyway, and ones naming a strategy run it.
UPDATE {schema}.outbox_subscribers SET subject_strategy = %(subject_strategy)s
 WHERE name = %(name)s;

-- name: set_routing
-- As set_subject_strategy: run only for subscribers with routing control (or losing
-- it), which need 0013.
UPDATE {schema}.outbox_subscribers SET routing = %(routing)s WHERE name = %(name)s;
-- name: set_key_format
-- Run for avro-registry subscribers only (0012 ships with 0011): other formats keep
-- their text keys, whatever the column says (list_subscribers reads it for them only).
UPDATE {schema}.outbox_subscribers SET key_format = %(key_format)s
 WHERE name = %(name)s;

-- name: insert_checkpoints
-- One checkpoint per part. start 'beginning': before every row; 'now': after every
-- transaction already decided.
INSERT INTO {schema}.outbox_checkpoints
    (subscriber, part, transaction_id, position, start_transaction_id, start_position)
SELECT %(name)s, part, start.xid, 0, start.xid, 0
  FROM pg_catalog.generate_series(0, %(parts)s - 1) AS part,
       LATERAL (SELECT CASE WHEN %(start)s = 'now' THEN pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())
                            ELSE '0'::xid8 END AS xid) AS start
ON CONFLICT (subscriber, part) DO NOTHING;

-- name: list_subscribers
-- subject_strategy through to_jsonb: NULL (the default, 'topic') on a schema before
-- 0011, which a relay of this version may run on during a rolling deploy.
SELECT s.name, s.aggregate_types, s.event_types, s.topic, s.value_format, s.paused,
       s.id, s.parts, s.on_poison, s.dead_letter_topic,
       pg_catalog.to_jsonb(s) ->> 'subject_strategy' AS subject_strategy,
       pg_catalog.to_jsonb(s) -> 'routing' AS routing,
       CASE WHEN s.value_format = 'avro-registry' THEN pg_catalog.to_jsonb(s) ->> 'key_format' END
           AS key_format
  FROM {schema}.outbox_subscribers s
 WHERE %(name)s::text IS NULL OR s.name = %(name)s
 ORDER BY s.name;

-- name: list_parts
-- With the events after each checkpoint that the operator skipped (`subscribers skip`,
-- migration 0019), looked up by message id; nothing to look up, no subquery run.
SELECT c.subscriber, c.part, c.transaction_id::text::bigint AS transaction_id, c.position,
       c.version, c.generation, c.owner, c.halted_error, c.updated_at,
       CASE WHEN c.skip_message_ids IS NOT NULL THEN
           ARRAY(SELECT o.message_id FROM {schema}.outbox o
                  WHERE o.message_id = ANY(c.skip_message_ids)
                    AND (o.transaction_id, o.position) > (c.transaction_id, c.position))
       END AS skips
  FROM {schema}.outbox_checkpoints c
 WHERE %(name)s::text IS NULL OR c.subscriber = %(name)s
 ORDER BY c.subscriber, c.part;

-- name: list_parts_without_skips
-- list_parts on a schema before migration 0019 (a rolling deploy): no skip list.
SELECT c.subscriber, c.part, c.transaction_id::text::bigint AS transaction_id, c.position,
       c.version, c.generation, c.owner, c.halted_error, c.updated_at
  FROM {schema}.outbox_checkpoints c
 WHERE %(name)s::text IS NULL OR c.subscriber = %(name)s
 ORDER BY c.subscriber, c.part;

-- name: get_part
-- With the events after the checkpoint that the operator skipped, as list_parts.
SELECT s.name, s.aggregate_types, s.event_types, s.topic, s.value_format, s.paused,
       s.id, s.parts, s.on_poison, s.dead_letter_topic,
       pg_catalog.to_jsonb(s) ->> 'subject_strategy' AS subject_strategy,
       pg_catalog.to_jsonb(s) -> 'routing' AS routing,
       CASE WHEN s.value_format = 'avro-registry' THEN pg_catalog.to_jsonb(s) ->> 'key_format' END
           AS key_format,
       c.part, c.transaction_id::text::bigint AS transaction_id, c.position, c.version,
       c.generation, c.owner, c.halted_error, c.updated_at,
       CASE WHEN c.skip_message_ids IS NOT NULL THEN
           ARRAY(SELECT o.message_id FROM {schema}.outbox o
                  WHERE o.message_id = ANY(c.skip_message_ids)
                    AND (o.transaction_id, o.position) > (c.transaction_id, c.position))
       END AS skips
  FROM {schema}.outbox_subscribers s
  JOIN {schema}.outbox_checkpoints c ON c.subscriber = s.name
 WHERE s.name = %(name)s AND c.part = %(part)s;

-- name: get_part_without_skips
-- get_part on a schema before migration 0019 (a rolling deploy): no skip list.
SELECT s.name, s.aggregate_types, s.event_types, s.topic, s.value_format, s.paused,
       s.id, s.parts, s.on_poison, s.dead_letter_topic,
       pg_catalog.to_jsonb(s) ->> 'subject_strategy' AS subject_strategy,
       pg_catalog.to_jsonb(s) -> 'routing' AS routing,
       CASE WHEN s.value_format = 'avro-registry' THEN pg_catalog.to_jsonb(s) ->> 'key_format' END
           AS key_format,
       c.part, c.transaction_id::text::bigint AS transaction_id, c.position, c.version,
       c.generation, c.owner, c.halted_error, c.updated_at
  FROM {schema}.outbox_subscribers s
  JOIN {schema}.outbox_checkpoints c ON c.subscriber = s.name
 WHERE s.name = %(name)s AND c.part = %(part)s;

-- name: advance_checkpoint
-- Compare-and-set: only the claiming session holding the current version may move
-- the checkpoint, and only forwards. A stale relay can neither rewind a checkpoint
-- nor overwrite a newer owner's.
-- %(synchronous_commit)s: 'off' commits without waiting for the WAL flush, for a
-- checkpoint Kafka also holds (docs/design.md §5); NULL keeps the session's setting.
-- set_config(..., true) lasts until this statement's transaction ends, and the join
-- makes sure it ran before any row is updated: one statement, one round trip.
WITH commit_mode AS (
    SELECT pg_catalog.set_config('synchronous_commit',
                      coalesce(%(synchronous_commit)s::text,
                               pg_catalog.current_setting('synchronous_commit')),
                      true)
)
UPDATE {schema}.outbox_checkpoints
   SET transaction_id = %(transaction_id)s::text::xid8, position = %(position)s,
       version = version + 1, updated_at = pg_catalog.now()
  FROM commit_mode
 WHERE subscriber = %(name)s AND part = %(part)s AND version = %(version)s
   AND owner = %(owner)s
   AND (transaction_id, position) <= (%(transaction_id)s::text::xid8, %(position)s)
RETURNING version;

-- name: dead_letters_between
-- Decisions already made for a batch's range (by this relay or a predecessor). Not
-- those redriven since (dead-letters redrive): after a reset, the relay publishes them
-- as it would any event (or decides anew if they are still poison).
SELECT message_id, topic, error FROM {schema}.outbox_dead_letters
 WHERE subscriber = %(name)s AND redriven_at IS NULL
   AND (transaction_id, position) > (%(from_tx)s::text::xid8, %(from_pos)s)
   AND (transaction_id, position) <= (%(to_tx)s::text::xid8, %(to_pos)s);

-- name: record_dead_letters
-- A batch's dead letters, in one statement: the arrays pair up by index (ROWS FROM:
-- unnest of several arrays, schema-qualified).
INSERT INTO {schema}.outbox_dead_letters
    (subscriber, part, transaction_id, position, message_id, topic, error)
SELECT %(name)s, %(part)s, l.transaction_id::text::xid8, l.position, l.message_id, l.topic,
       l.error
  FROM ROWS FROM (pg_catalog.unnest(%(transaction_ids)s::bigint[]),
                  pg_catalog.unnest(%(positions)s::bigint[]),
                  pg_catalog.unnest(%(message_ids)s::uuid[]),
                  pg_catalog.unnest(%(topics)s::text[]),
                  pg_catalog.unnest(%(errors)s::text[]))
       AS l(transaction_id, position, message_id, topic, error)
ON CONFLICT DO NOTHING;

-- name: halt_part
-- halted_message_id: the poison event, if the halt names one (migration 0019).
UPDATE {schema}.outbox_checkpoints
   SET halted_at = pg_catalog.now(), halted_error = %(error)s,
       halted_message_id = %(message_id)s, version = version + 1
 WHERE subscriber = %(name)s AND part = %(part)s AND owner = %(owner)s
RETURNING version;

-- name: halt_part_without_message_id
-- halt_part on a schema before migration 0019 (a rolling deploy).
UPDATE {schema}.outbox_checkpoints
   SET halted_at = pg_catalog.now(), halted_error = %(error)s, version = version + 1
 WHERE subscriber = %(name)s AND part = %(part)s AND owner = %(owner)s
RETURNING version;

-- name: record_wait
-- What the part waits for (NULL: nothing) and since when its wait began (issue #48,
-- migration 0020; relay/engine/waiting.py). Only its owner writes it; neither version
-- nor updated_at moves, as the checkpoint did not; an unchanged row is not written.
UPDATE {schema}.outbox_checkpoints
   SET waiting_on = %(waits_on)s::text, waiting_error = %(error)s::text,
       waiting_since = CASE WHEN %(waits_on)s::text IS NOT NULL
                            THEN coalesce(waiting_since, pg_catalog.now()) END
 WHERE subscriber = %(name)s AND part = %(part)s AND owner = %(owner)s
   AND (waiting_on, waiting_error) IS DISTINCT FROM (%(waits_on)s::text, %(error)s::text);

-- name: part_waits
-- The parts a live relay owns that wait, what for and since when (issue #48). Read
-- through to_jsonb, so that a schema before migration 0020 answers with none; a part
-- no live relay owns is left out (its wait was a past owner's).
SELECT c.subscriber, c.part, w.waiting_on, w.waiting_error, w.waiting_since
  FROM {schema}.outbox_checkpoints c
 CROSS JOIN LATERAL pg_catalog.jsonb_to_record(pg_catalog.to_jsonb(c))
       AS w(waiting_on text, waiting_error text, waiting_since timestamptz)
 WHERE w.waiting_on IS NOT NULL
   AND EXISTS (SELECT FROM {schema}.outbox_relay_sessions s
                WHERE s.id = c.owner AND s.expires_at > pg_catalog.now())
 ORDER BY c.subscriber, c.part;

-- name: set_paused
-- Resuming also clears a poison halt. Bumps the checkpoint versions so a running
-- relay notices at its next checkpoint.
WITH s AS (
    UPDATE {schema}.outbox_subscribers SET paused = %(paused)s, updated_at = pg_catalog.now()
     WHERE name = %(name)s RETURNING name
)
UPDATE {schema}.outbox_checkpoints c
   SET version = version + 1,
       halted_at = CASE WHEN %(paused)s THEN halted_at END,
       halted_error = CASE WHEN %(paused)s THEN halted_error END
  FROM s WHERE c.subscriber = s.name
RETURNING c.subscriber;

-- name: reset_checkpoint
-- A new generation: Kafka-side checkpoints from before the reset no longer apply, and
-- verify expects only what is published after the new start. A reset forward records
-- where it jumped from (skipped_from_*), so status and verify count the events it
-- skipped; a second reset forward before anything was published keeps the first one's
-- origin. The caller has refused a point beyond the horizon (OutboxStore.reset).
UPDATE {schema}.outbox_checkpoints c
   SET transaction_id = t.xid, position = t.pos,
       start_transaction_id = t.xid, start_position = t.pos,
       skipped_from_transaction_id = CASE
           WHEN (t.xid, t.pos) <= (c.transaction_id, c.position) THEN NULL
           WHEN (c.transaction_id, c.position) = (c.start_transaction_id, c.start_position)
                AND c.skipped_from_transaction_id IS NOT NULL THEN c.skipped_from_transaction_id
           ELSE c.transaction_id END,
       skipped_from_position = CASE
           WHEN (t.xid, t.pos) <= (c.transaction_id, c.position) THEN NULL
           WHEN (c.transaction_id, c.position) = (c.start_transaction_id, c.start_position)
                AND c.skipped_from_transaction_id IS NOT NULL THEN c.skipped_from_position
           ELSE c.position END,
       version = version + 1, generation = pg_catalog.gen_random_uuid(),
       halted_at = NULL, halted_error = NULL, updated_at = pg_catalog.now()
  FROM (SELECT CASE %(to)s
                   WHEN 'beginning' THEN '0'::xid8
                   WHEN 'now' THEN pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())
                   ELSE %(transaction_id)s::text::xid8 END AS xid,
               CASE WHEN %(to)s = 'position' THEN %(position)s::bigint ELSE 0 END AS pos) AS t
 WHERE c.subscriber = %(name)s
RETURNING c.subscriber;

-- name: horizon
-- Every transaction below it has committed or rolled back (docs/design.md §1).
SELECT pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())::text::bigint;

-- name: part_skips
-- For each part of a subscriber: whether its checkpoint lies beyond the horizon (then
-- every row written now sorts before it and is never published); the events the
-- operator skipped, from the ledger (migration 0019: every reset forward's range and
-- every `subscribers skip`, counted when they were made, so they stay reported across
-- any number of later resets); and, for a checkpoint beyond the horizon (an older
-- version's reset, or one written by hand: a reset refuses such a point), which has not
-- moved since it was set: the rows written since (occurred_at from then on, newest first), of which at
-- most %(scan)s scanned (NULL: all), and how many of those are the part's.
SELECT c.part,
       (c.transaction_id, c.position)
           > (pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot()), 0)
           AS beyond_horizon,
       b.scanned, b.counted,
       coalesce(k.by_reset, 0) AS by_reset, coalesce(k.by_skip, 0) AS by_skip
  FROM {schema}.outbox_checkpoints c
  JOIN {schema}.outbox_subscribers s ON s.name = c.subscriber
  LEFT JOIN LATERAL (
       SELECT pg_catalog.sum(x.events) FILTER (WHERE x.message_id IS NULL)::bigint AS by_reset,
              pg_catalog.sum(x.events) FILTER (WHERE x.message_id IS NOT NULL)::bigint AS by_skip
         FROM {schema}.outbox_skipped x
        WHERE x.subscriber_id = s.id AND x.part = c.part) AS k ON true
  LEFT JOIN LATERAL (
       SELECT pg_catalog.count(*) AS scanned,
              pg_catalog.count(*) FILTER (
                  WHERE r.occurred_at >= c.updated_at
                    AND (s.parts = 1 OR {schema}.outbox_part(r.aggregate_id, s.parts) = c.part)
                    AND (s.aggregate_types IS NULL OR r.aggregate_type = ANY(s.aggregate_types))
                    AND (s.event_types IS NULL OR r.event_type = ANY(s.event_types))) AS counted
         FROM (SELECT o.aggregate_id, o.aggregate_type, o.event_type, o.occurred_at
                 FROM {schema}.outbox o
                WHERE (o.transaction_id, o.position) <= (c.transaction_id, c.position)
                ORDER BY o.transaction_id DESC, o.position DESC
                LIMIT %(scan)s) AS r) AS b
    ON (c.transaction_id, c.position)
           > (pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot()), 0)
 WHERE c.subscriber = %(name)s
 ORDER BY c.part;

-- name: part_skips_before_ledger
-- part_skips on a schema before migration 0019 (a rolling deploy): the last reset only.
-- For each part of a subscriber: whether its checkpoint lies beyond the horizon (then
-- every row written now sorts before it and is never published), and the events its
-- last reset forward skipped, matching the subscriber's filters: of the rows after
-- skipped_from up to the start, at most %(scan)s scanned (NULL: all), and how many of
-- those are the part's. A checkpoint beyond the horizon that no reset of this version
-- recorded (an older version's, or one written by hand) has not moved since it was
-- set: the rows written since (occurred_at from then on, newest first) are the ones it
-- jumped over.
SELECT c.part,
       (c.transaction_id, c.position) > (pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot()), 0)
           AS beyond_horizon,
       coalesce(k.scanned, b.scanned) AS scanned, coalesce(k.counted, b.counted) AS counted
  FROM {schema}.outbox_checkpoints c
  JOIN {schema}.outbox_subscribers s ON s.name = c.subscriber
  LEFT JOIN LATERAL (
       SELECT pg_catalog.count(*) AS scanned,
              pg_catalog.count(*) FILTER (
                  WHERE (s.parts = 1 OR {schema}.outbox_part(r.aggregate_id, s.parts) = c.part)
                    AND (s.aggregate_types IS NULL OR r.aggregate_type = ANY(s.aggregate_types))
                    AND (s.event_types IS NULL OR r.event_type = ANY(s.event_types))) AS counted
         FROM (SELECT o.aggregate_id, o.aggregate_type, o.event_type
                 FROM {schema}.outbox o
                WHERE (o.transaction_id, o.position)
                          > (c.skipped_from_transaction_id, c.skipped_from_position)
                  AND (o.transaction_id, o.position) <= (c.start_transaction_id, c.start_position)
                ORDER BY o.transaction_id, o.position
                LIMIT %(scan)s) AS r) AS k
    ON c.skipped_from_transaction_id IS NOT NULL
  LEFT JOIN LATERAL (
       SELECT pg_catalog.count(*) AS scanned,
              pg_catalog.count(*) FILTER (
                  WHERE r.occurred_at >= c.updated_at
                    AND (s.parts = 1 OR {schema}.outbox_part(r.aggregate_id, s.parts) = c.part)
                    AND (s.aggregate_types IS NULL OR r.aggregate_type = ANY(s.aggregate_types))
                    AND (s.event_types IS NULL OR r.event_type = ANY(s.event_types))) AS counted
         FROM (SELECT o.aggregate_id, o.aggregate_type, o.event_type, o.occurred_at
                 FROM {schema}.outbox o
                WHERE (o.transaction_id, o.position) <= (c.transaction_id, c.position)
                ORDER BY o.transaction_id DESC, o.position DESC
                LIMIT %(scan)s) AS r) AS b
    ON c.skipped_from_transaction_id IS NULL
   AND (c.transaction_id, c.position) > (pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot()), 0)
 WHERE c.subscriber = %(name)s
 ORDER BY c.part;

-- name: delete_subscriber
DELETE FROM {schema}.outbox_subscribers WHERE name = %(name)s RETURNING name, parts;

-- name: pin_search_path
-- On every connection the relay opens, once (relay/adapters/postgres/db.py): the
-- search_path it resolves names in. Qualified itself: it runs before the path is pinned.
SELECT pg_catalog.set_config('search_path', %(search_path)s::text, false);

-- name: pin_search_path_locally
-- The same, until the transaction ends: each migration's (relay/adapters/postgres/migrations.py),
-- whatever the connection it is given.
SELECT pg_catalog.set_config('search_path', %(search_path)s::text, true);

-- name: use_role_search_path
-- Until the transaction ends, the search_path the connecting role has without the
-- relay's pin (its own, its database's or the server's setting): for the names an
-- operator gives unqualified (relay/adapters/postgres/db.py, role_search_path).
SELECT pg_catalog.set_config('search_path', s.reset_val, true)
  FROM pg_catalog.pg_settings s WHERE s.name = 'search_path';

-- name: current_schemas
SELECT pg_catalog.current_schemas(false)::text[];

-- name: schemas_public_may_create_in
-- Of the relay's schema and the schemas on the connecting role's own search_path, those
-- in which every role (PUBLIC) may CREATE, as Postgres before 15 lets it in `public`
-- (relay/adapters/postgres/namespaces.py).
SELECT n.nspname::text, n.nspname = %(schema)s::text AS own
  FROM pg_catalog.pg_namespace n
 WHERE (n.nspname = %(schema)s::text OR n.nspname = ANY(%(path)s::text[]))
   AND pg_catalog.has_schema_privilege('public', n.oid, 'CREATE')
 ORDER BY n.nspname;

-- name: configure_daemon_session
-- On each connection of the relay daemon, once (relay/adapters/postgres/db.py), instead
-- of pin_search_path: the search_path; the timeouts in milliseconds, '0' for none; and
-- UTC as the session's time zone. psycopg
-- loads a timestamptz into the session's zone: a zoneinfo zone (a server's 'Etc/UTC' or
-- 'Europe/Berlin') costs about 0.4 us more per row to load than UTC, and about 0.45 us
-- more per event when the commit-latency histogram subtracts it from now
-- (bench/README.md, levers). Every occurred_at the relay renders is in UTC too.
SELECT pg_catalog.set_config('search_path', %(search_path)s::text, false),
       pg_catalog.set_config('statement_timeout', %(statement_timeout)s::text, false),
       pg_catalog.set_config('lock_timeout', %(lock_timeout)s::text, false),
       pg_catalog.set_config('idle_in_transaction_session_timeout', %(idle_in_transaction)s::text, false),
       pg_catalog.set_config('TimeZone', 'UTC', false);

-- name: open_session
INSERT INTO {schema}.outbox_relay_sessions (hostname, pid, expires_at)
VALUES (%(hostname)s, %(pid)s, pg_catalog.now() + pg_catalog.make_interval(secs => %(timeout)s))
RETURNING id;

-- name: heartbeat
UPDATE {schema}.outbox_relay_sessions
   SET heartbeat_at = pg_catalog.now(), expires_at = pg_catalog.now() + pg_catalog.make_interval(secs => %(timeout)s)
 WHERE id = %(id)s
RETURNING id;

-- name: expire_sessions
DELETE FROM {schema}.outbox_relay_sessions WHERE expires_at < pg_catalog.now() RETURNING id, hostname, pid;

-- name: next_expiry
-- Seconds until the soonest live session expires (NULL: none): a peer's keeper expires
-- it then, not at its next beat (issue #49).
SELECT pg_catalog.date_part('epoch', pg_catalog.min(expires_at) - pg_catalog.now())
  FROM {schema}.outbox_relay_sessions WHERE expires_at >= pg_catalog.now();

-- name: close_session
DELETE FROM {schema}.outbox_relay_sessions WHERE id = %(id)s;

-- name: live_sessions
SELECT id FROM {schema}.outbox_relay_sessions WHERE expires_at >= pg_catalog.now() ORDER BY id;

-- name: claim_part
-- Bumps the version, so a checkpoint write by any earlier owner fails its CAS.
UPDATE {schema}.outbox_checkpoints SET owner = %(owner)s, version = version + 1
 WHERE subscriber = %(name)s AND part = %(part)s AND owner IS NULL
RETURNING part;

-- name: release_part
UPDATE {schema}.outbox_checkpoints SET owner = NULL, version = version + 1
 WHERE subscriber = %(name)s AND part = %(part)s AND owner = %(owner)s
RETURNING part;

-- name: horizon_holders
-- Transactions whose ids hold pg_snapshot_xmin back, oldest first: no event written
-- after their xid is published until they end. Open sessions' (pg_stat_activity), and
-- prepared transactions' (pg_prepared_xacts, of any database: the horizon is the
-- cluster's), which no session shows and which stay until COMMIT/ROLLBACK PREPARED.
SELECT pid, xid, state, application_name, age_s, query_start, gid, owner, database
  FROM (SELECT pid, backend_xid::text AS xid, state, application_name,
               extract(epoch FROM pg_catalog.now() - xact_start)::float8 AS age_s, query_start,
               NULL::text AS gid, NULL::text AS owner, NULL::text AS database,
               pg_catalog.age(backend_xid) AS xid_age
          FROM pg_stat_activity
         WHERE backend_xid IS NOT NULL AND pid <> pg_catalog.pg_backend_pid()
        UNION ALL
        SELECT NULL, transaction::text, 'prepared', NULL,
               extract(epoch FROM pg_catalog.now() - prepared)::float8, NULL,
               gid, owner::text, database::text, pg_catalog.age(transaction)
          FROM pg_prepared_xacts) AS holders
 ORDER BY xid_age DESC
 LIMIT 5;

-- name: list_sessions
SELECT s.id, s.hostname, s.pid, s.started_at,
       extract(epoch FROM pg_catalog.now() - s.heartbeat_at)::float8 AS heartbeat_age_s,
       s.expires_at < pg_catalog.now() AS expired,
       (SELECT pg_catalog.count(*) FROM {schema}.outbox_checkpoints c WHERE c.owner = s.id) AS parts
  FROM {schema}.outbox_relay_sessions s
 ORDER BY s.started_at;

-- name: prune
-- One batch of retention (migration 0008): published rows older than the retention.
SELECT {schema}.outbox_prune(%(older_than)s::float8, %(limit)s::integer);

-- name: prune_redriven_dead_letters
-- Retention of dead letters (migration 0016), one batch: redriven ones whose event the
-- outbox's retention pruned (with it, verify would expect the event in order).
-- %(name)s: one subscriber's; NULL: every subscriber's.
WITH doomed AS (
    SELECT d.ctid FROM {schema}.outbox_dead_letters d
     WHERE (%(name)s::text IS NULL OR d.subscriber = %(name)s::text)
       AND d.redriven_at IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM {schema}.outbox o
                        WHERE o.transaction_id = d.transaction_id AND o.position = d.position)
     LIMIT %(limit)s
)
DELETE FROM {schema}.outbox_dead_letters WHERE ctid IN (SELECT ctid FROM doomed);

-- name: prune_pending_dead_letters
-- Dead letters not yet redriven, decided more than %(older_than)s seconds ago, one batch:
-- only when the operator asks (`dead-letters prune --pending-older-than`, or the
-- dead_letter_retention setting). Never one a redrive has in flight (redrive_batch).
WITH doomed AS (
    SELECT d.ctid FROM {schema}.outbox_dead_letters d
     WHERE (%(name)s::text IS NULL OR d.subscriber = %(name)s::text)
       AND d.redriven_at IS NULL AND d.redrive_batch IS NULL
       AND d.decided_at < pg_catalog.now() - pg_catalog.make_interval(secs => %(older_than)s::float8)
     LIMIT %(limit)s
)
DELETE FROM {schema}.outbox_dead_letters WHERE ctid IN (SELECT ctid FROM doomed);

-- name: prune_bound
-- Before migration 0008 (a rolling deploy), prune_bound and prune_batch instead.
-- The oldest part checkpoint of all subscribers: every row at or before it is
-- published for everyone (no row when there is no subscriber: prune nothing).
SELECT c.transaction_id::text::bigint, c.position FROM {schema}.outbox_checkpoints c
 ORDER BY c.transaction_id, c.position
 LIMIT 1;

-- name: prune_batch
-- Published rows older than the retention, one batch at a time (short transactions,
-- so autovacuum keeps up instead of one huge delete bloating the table). A stream's
-- latest version stays: the next event-sourced append checks that it exists.
WITH doomed AS (
    SELECT o.ctid FROM {schema}.outbox o
     WHERE (o.transaction_id, o.position) <= (%(transaction_id)s::text::xid8, %(position)s)
       AND o.occurred_at < pg_catalog.now() - pg_catalog.make_interval(secs => %(older_than)s)
       AND (o.aggregate_version IS NULL OR EXISTS (
             SELECT 1 FROM {schema}.outbox n
              WHERE n.aggregate_type = o.aggregate_type AND n.aggregate_id = o.aggregate_id
                AND n.aggregate_version = o.aggregate_version + 1))
     ORDER BY o.transaction_id, o.position
     LIMIT %(limit)s
)
DELETE FROM {schema}.outbox WHERE ctid IN (SELECT ctid FROM doomed);

-- name: check_key_space
-- Run by every relay connection before it publishes or prunes (relay/core/key_space.py).
SELECT action, key_space, rebased_rows, detail FROM {schema}.outbox_check_key_space();

-- name: key_space
SELECT id, previous_id, moved_high::text::bigint AS moved_high FROM {schema}.outbox_key_space;

-- name: key_of_message
SELECT transaction_id::text::bigint, position FROM {schema}.outbox WHERE message_id = %(message_id)s;

-- name: messages_at_keys
-- The message id at each of a Kafka-side checkpoint's dead-letter keys (recovery).
SELECT o.transaction_id::text::bigint, o.position, o.message_id
  FROM ROWS FROM (pg_catalog.unnest(%(transaction_ids)s::bigint[]),
                  pg_catalog.unnest(%(positions)s::bigint[])) AS k(transaction_id, position)
  JOIN {schema}.outbox o
    ON o.transaction_id = k.transaction_id::text::xid8 AND o.position = k.position;

-- name: translate_key
SELECT xid::text::bigint, pos
  FROM {schema}.outbox_translate_key(%(key_space)s::uuid, %(transaction_id)s::text::xid8, %(position)s::bigint);

-- name: sees_all_backends
-- Whether pg_stat_activity shows this role the transaction ids of every role's backends
-- (a superuser, or a member of pg_read_all_stats). Without it, horizon_holders sees
-- only the backends of its own role.
SELECT pg_catalog.pg_has_role(current_user, 'pg_read_all_stats', 'USAGE');

-- name: part_lag
-- What a part's lag is computed from (relay/ops/lag.py), however long its backlog: the rows
-- after its checkpoint, decided or not, scanned in key order up to %(scan)s (an index
-- range scan that stops there), how many of them are the part's and match the
-- subscriber's filters, the position of the first and of the newest row (positions
-- come from one identity sequence: beyond the scan, their difference estimates the
-- rows), and how long ago the database recorded the oldest of the part's rows among
-- those scanned (recorded_at, migration 0018: never occurred_at, which writers set).
WITH scanned AS (
    SELECT o.transaction_id, o.position, o.recorded_at,
           (%(parts)s = 1 OR {schema}.outbox_part(o.aggregate_id, %(parts)s::integer) = %(part)s)
           AND (%(aggregate_types)s::text[] IS NULL
                OR o.aggregate_type = ANY(%(aggregate_types)s::text[]))
           AND (%(event_types)s::text[] IS NULL OR o.event_type = ANY(%(event_types)s::text[]))
               AS mine
      FROM {schema}.outbox o
     WHERE (o.transaction_id, o.position) > (%(transaction_id)s::text::xid8, %(position)s)
     ORDER BY o.transaction_id, o.position
     LIMIT %(scan)s
)
SELECT (SELECT pg_catalog.count(*) FROM scanned) AS scanned,
       (SELECT pg_catalog.count(*) FROM scanned s WHERE s.mine) AS counted,
       (SELECT s.position FROM scanned s ORDER BY s.transaction_id, s.position LIMIT 1)
           AS first_position,
       (SELECT n.position FROM {schema}.outbox n
         ORDER BY n.transaction_id DESC, n.position DESC LIMIT 1) AS last_position,
       (SELECT extract(epoch FROM pg_catalog.now() - pg_catalog.min(s.recorded_at))::float8
          FROM scanned s WHERE s.mine) AS age_s;

-- name: part_lag_by_occurred_at
-- part_lag on a schema without recorded_at (a rolling deploy: relays rolled before
-- `migrate`): the age of the first row's occurred_at, as before migration 0018.
WITH scanned AS (
    SELECT o.transaction_id, o.position, o.occurred_at,
           (%(parts)s = 1 OR {schema}.outbox_part(o.aggregate_id, %(parts)s::integer) = %(part)s)
           AND (%(aggregate_types)s::text[] IS NULL
                OR o.aggregate_type = ANY(%(aggregate_types)s::text[]))
           AND (%(event_types)s::text[] IS NULL OR o.event_type = ANY(%(event_types)s::text[]))
               AS mine
      FROM {schema}.outbox o
     WHERE (o.transaction_id, o.position) > (%(transaction_id)s::text::xid8, %(position)s)
     ORDER BY o.transaction_id, o.position
     LIMIT %(scan)s
)
SELECT (SELECT pg_catalog.count(*) FROM scanned) AS scanned,
       (SELECT pg_catalog.count(*) FROM scanned s WHERE s.mine) AS counted,
       (SELECT s.position FROM scanned s ORDER BY s.transaction_id, s.position LIMIT 1)
           AS first_position,
       (SELECT n.position FROM {schema}.outbox n
         ORDER BY n.transaction_id DESC, n.position DESC LIMIT 1) AS last_position,
       (SELECT extract(epoch FROM pg_catalog.now() - s.occurred_at)::float8 FROM scanned s
         WHERE s.mine ORDER BY s.transaction_id, s.position LIMIT 1) AS age_s;

-- name: advisory_lock_holder
-- The session holding advisory lock %(key)s in this database (relay/adapters/postgres/advisory.py):
-- Postgres files a bigint key as classid = its high 32 bits, objid = its low 32 bits,
-- objsubid = 1. pg_stat_activity shows any role the pid, role and application_name of
-- every session.
SELECT l.pid, a.usename::text, a.application_name
  FROM pg_catalog.pg_locks l
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
   AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d
                      WHERE d.datname = pg_catalog.current_database())
   AND l.classid = ((%(key)s::bigint >> 32) & 4294967295)::oid
   AND l.objid = (%(key)s::bigint & 4294967295)::oid
 LIMIT 1;

-- name: advisory_try_xact_lock
SELECT pg_catalog.pg_try_advisory_xact_lock(%(key)s::bigint);

-- name: advisory_xact_lock
-- Waits for the lock at most %(wait_ms)s (a lock_timeout for this transaction), and
-- returns the lock_timeout it replaced, which the caller puts back for the rest of the
-- transaction. The CTEs run in order: each reads the one before.
WITH previous AS MATERIALIZED (
    SELECT pg_catalog.current_setting('lock_timeout') AS lock_timeout
), bounded AS MATERIALIZED (
    SELECT pg_catalog.set_config('lock_timeout', %(wait_ms)s::text, true) FROM previous
)
SELECT p.lock_timeout, pg_catalog.pg_advisory_xact_lock(%(key)s::bigint)
  FROM previous p, bounded;

-- name: restore_lock_timeout
SELECT pg_catalog.set_config('lock_timeout', %(lock_timeout)s::text, true);
