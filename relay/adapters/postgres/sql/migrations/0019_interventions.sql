-- Operators' interventions on the record, and skips of one event (issue #48).

-- 1. The ledger: every operator action that changes what a subscriber publishes (skip,
-- reset, replay, redrive, set, pause, resume, remove, add, replace), with who (the
-- database role, and the OS user and host the command line reports), when, what (the
-- action's parameters) and how many events. Keyed by the subscriber's name and id, with
-- no foreign key: it outlives `subscribers remove`. Append-only for the relay role
-- (roles.sql grants INSERT, and not on recorded_at and db_role, which the database
-- fills in: a client cannot write another role's name or another time).
CREATE TABLE {schema}.outbox_interventions (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscriber    text NOT NULL,
    subscriber_id uuid,
    action        text NOT NULL CHECK (action IN ('add', 'replace', 'set', 'pause', 'resume',
                                                  'reset', 'skip', 'remove', 'redrive', 'replay',
                                                  'prune')),
    recorded_at   timestamptz NOT NULL DEFAULT pg_catalog.statement_timestamp(),
    -- session_user is SQL syntax, not a function looked up on the search_path.
    db_role       text NOT NULL DEFAULT session_user,
    os_user       text CHECK (pg_catalog.octet_length(os_user) <= 256),
    host          text CHECK (pg_catalog.octet_length(host) <= 256),
    params        jsonb NOT NULL DEFAULT '{{}}'::jsonb
                  CHECK (pg_catalog.jsonb_typeof(params) = 'object'),
    -- Events the action skipped, republished or changed course for; NULL: not counted.
    events        bigint CHECK (events >= 0)
);

CREATE INDEX outbox_interventions_subscriber ON {schema}.outbox_interventions (subscriber, id);

-- 2. What the operator skipped, per part: one event (`subscribers skip`), or the range a
-- reset forward jumped over, (after, upto], with the part's events in it that the
-- subscriber's filters match. status, subscribers list and verify read it: every
-- skip stays reported, across any number of later resets. Append-only, as the ledger.
CREATE TABLE {schema}.outbox_skipped (
    intervention  bigint NOT NULL REFERENCES {schema}.outbox_interventions (id),
    subscriber_id uuid NOT NULL,
    part          integer NOT NULL CHECK (part >= 0),
    message_id    uuid,
    after_transaction_id xid8,
    after_position bigint,
    upto_transaction_id xid8,
    upto_position bigint,
    events        bigint NOT NULL CHECK (events >= 0),
    CONSTRAINT outbox_skipped_event_or_range CHECK (
        (message_id IS NOT NULL AND events = 1 AND after_transaction_id IS NULL
         AND after_position IS NULL AND upto_transaction_id IS NULL AND upto_position IS NULL)
        OR (message_id IS NULL AND after_transaction_id IS NOT NULL
            AND after_position IS NOT NULL AND upto_transaction_id IS NOT NULL
            AND upto_position IS NOT NULL))
);

CREATE INDEX outbox_skipped_part ON {schema}.outbox_skipped (subscriber_id, part);
CREATE UNIQUE INDEX outbox_skipped_event ON {schema}.outbox_skipped (subscriber_id, message_id)
    WHERE message_id IS NOT NULL;

-- 3. The part's own state: the events the operator skipped (message ids; the relay drops
-- them when it meets them, and reads only those after the checkpoint), and the event a
-- poison halt stopped on (read only while halted_error is set).
ALTER TABLE {schema}.outbox_checkpoints
    ADD COLUMN skip_message_ids uuid[],
    ADD COLUMN halted_message_id uuid;

-- 4. The resets recorded before the ledger: migration 0009 kept the last reset forward
-- of each part (skipped_from_*, up to the generation's start). It goes on the record,
-- counted as status counted it, so no skip vanishes from status on upgrade.
WITH last_reset AS (
    SELECT s.name, s.id, c.part, c.skipped_from_transaction_id AS after_transaction_id,
           c.skipped_from_position AS after_position,
           c.start_transaction_id AS upto_transaction_id, c.start_position AS upto_position,
           (SELECT pg_catalog.count(*) FROM {schema}.outbox o
             WHERE (o.transaction_id, o.position)
                       > (c.skipped_from_transaction_id, c.skipped_from_position)
               AND (o.transaction_id, o.position) <= (c.start_transaction_id, c.start_position)
               AND (s.parts = 1 OR {schema}.outbox_part(o.aggregate_id, s.parts) = c.part)
               AND (s.aggregate_types IS NULL OR o.aggregate_type = ANY(s.aggregate_types))
               AND (s.event_types IS NULL OR o.event_type = ANY(s.event_types))) AS events
      FROM {schema}.outbox_checkpoints c
      JOIN {schema}.outbox_subscribers s ON s.name = c.subscriber
     WHERE c.skipped_from_transaction_id IS NOT NULL
), recorded AS (
    INSERT INTO {schema}.outbox_interventions (subscriber, subscriber_id, action, params, events)
    SELECT l.name, l.id, 'reset',
           pg_catalog.jsonb_build_object(
               'recorded_by', 'migration 0019: the last reset forward of each part before '
                              'the ledger (who and when were not kept)'),
           pg_catalog.sum(l.events)
      FROM last_reset l
     GROUP BY l.name, l.id
    RETURNING id, subscriber_id
)
INSERT INTO {schema}.outbox_skipped (intervention, subscriber_id, part, after_transaction_id,
                                     after_position, upto_transaction_id, upto_position, events)
SELECT r.id, l.id, l.part, l.after_transaction_id, l.after_position, l.upto_transaction_id,
       l.upto_position, l.events
  FROM last_reset l
  JOIN recorded r ON r.subscriber_id = l.id;
