-- The topics this outbox created (issue #47; docs/design.md §7, "Rows name topics").
-- A row whose template field is free may publish to an existing topic only if it is
-- recorded here, a filter names it, or topic_allow matches it: a writer can no longer
-- publish into another outbox's topic. The topics rows made count against
-- max_created_topics here, under a lock, so the cap holds exactly across relays.
CREATE TABLE {schema}.outbox_topics (
    topic       text PRIMARY KEY CHECK (pg_catalog.octet_length(topic) BETWEEN 1 AND 249),
    -- 'row': a row's free template field named it (counted against max_created_topics);
    -- 'declared': a subscriber's fixed topic, or one its filters name (never counted);
    -- 'adopted': on the cluster when a relay first started after this migration.
    origin      text NOT NULL CHECK (origin IN ('row', 'declared', 'adopted')),
    recorded_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);

-- An outbox that published before this migration: its relays created topics that are
-- not recorded. The first relay to start adopts the existing topics its subscribers'
-- templates reach, and deletes this row (relay/daemon/startup.py). A new outbox (no
-- subscriber yet) starts with an empty record and adopts nothing.
CREATE TABLE {schema}.outbox_topic_adoption (
    requested_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);
INSERT INTO {schema}.outbox_topic_adoption (requested_at)
SELECT pg_catalog.now() WHERE EXISTS (SELECT FROM {schema}.outbox_subscribers);
