-- The topics the outbox created (migration 0017; relay/adapters/postgres/topic_record.py).
-- {schema} is a quoted identifier.

-- name: recorded
SELECT topic FROM {schema}.outbox_topics;

-- name: record
INSERT INTO {schema}.outbox_topics (topic, origin)
SELECT t, %(origin)s FROM pg_catalog.unnest(%(topics)s::text[]) t
ON CONFLICT (topic) DO NOTHING;

-- name: lock
-- Reservations one at a time, per outbox schema: two relays counting at once would
-- each see room for the last topic.
SELECT pg_catalog.pg_advisory_xact_lock(
    pg_catalog.hashtextextended('outbox-relay.topics.' || %(schema)s, 0));

-- name: reserve
-- A row's topic, recorded before it is created, if the rows' topics leave room (under
-- the lock above). Returns the topic when it is recorded, now or before.
WITH added AS (
    INSERT INTO {schema}.outbox_topics (topic, origin)
    SELECT %(topic)s, 'row'
     WHERE %(cap)s::integer IS NULL
        OR (SELECT pg_catalog.count(*) FROM {schema}.outbox_topics WHERE origin = 'row')
           < %(cap)s::integer
    ON CONFLICT (topic) DO NOTHING
    RETURNING topic
)
SELECT topic FROM added
UNION ALL
SELECT topic FROM {schema}.outbox_topics WHERE topic = %(topic)s;

-- name: release
DELETE FROM {schema}.outbox_topics WHERE topic = %(topic)s AND origin = 'row';

-- name: row_topics
SELECT pg_catalog.count(*) FROM {schema}.outbox_topics WHERE origin = 'row';

-- name: adoption_pending
SELECT EXISTS (SELECT FROM {schema}.outbox_topic_adoption);

-- name: adoption_claim
-- Whichever relay deletes the request adopts; the others find it gone.
DELETE FROM {schema}.outbox_topic_adoption RETURNING requested_at;
