-- What a part waits for, and since when (issue #48). A part that waits (for a topic to
-- be created with create_topics = false, a privilege or an ACL to be granted again, the
-- schema registry, room in max_created_topics) used to show only in the memory of the
-- relay running it: `status`, which reads Postgres, showed it as active. Its worker now
-- records the wait here when it starts and clears it once the part publishes again
-- (relay/engine/waiting.py: a write per change, at most one every 30 s per part). No
-- checkpoint change: neither version nor updated_at moves. The relay role holds UPDATE
-- on the table already; a relay on a schema before this migration records nothing, and
-- `status` reads the columns through to_jsonb, so either order of upgrade works.

ALTER TABLE {schema}.outbox_checkpoints
    ADD COLUMN waiting_on text,
    ADD COLUMN waiting_error text,
    ADD COLUMN waiting_since timestamptz;
