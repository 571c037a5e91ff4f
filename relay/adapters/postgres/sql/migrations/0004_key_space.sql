-- Restore safety: the ordering keys are transaction ids of the cluster that wrote them.
-- After pg_dump/pg_restore into another cluster (or logical replication, or a backward
-- pg_resetwal) the new cluster may hand out ids below the stored ones: unpublished rows
-- would wait for the horizon to pass their ids, and new rows would sort before the
-- checkpoint and never be published. docs/design.md, "Moving the database", has the
-- reasoning; this migration adds what the relay needs to notice and repair it.

-- One row: which key space the stored keys are in, and the highest id seen in it.
CREATE TABLE {schema}.outbox_key_space (
    singleton         boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    -- Changes when the keys are rebased: Kafka-side checkpoints carry it, so one
    -- written in another key space is never compared with these keys.
    id                uuid NOT NULL DEFAULT gen_random_uuid(),
    previous_id       uuid,
    system_identifier bigint NOT NULL,
    -- A transaction id of this space at the last check: a cluster whose next id is
    -- not above it (and above every stored key) is not the cluster that wrote them.
    high_water        xid8 NOT NULL,
    -- Set when the cluster changed but the keys carried on (pg_upgrade, or a restore
    -- into a cluster whose ids were already higher): the highest key from before it.
    moved_high        xid8,
    checked_at        timestamptz NOT NULL DEFAULT now(),
    rebased_at        timestamptz,
    rebased_rows      bigint NOT NULL DEFAULT 0
);

INSERT INTO {schema}.outbox_key_space (system_identifier, high_water)
SELECT system_identifier, pg_current_xact_id() FROM pg_control_system();

-- Each rebased row's key before the rebase: a Kafka-side checkpoint written in the
-- previous key space is translated through it.
CREATE TABLE {schema}.outbox_rebased_keys (
    from_key_space        uuid NOT NULL,
    origin_transaction_id xid8 NOT NULL,
    origin_position       bigint NOT NULL,
    position              bigint NOT NULL,
    PRIMARY KEY (from_key_space, origin_transaction_id, origin_position)
);

-- Called by every relay connection before it publishes or prunes (and by migrate):
-- checks that the stored keys belong to this cluster's xid space and, if not, rebases
-- them. SECURITY DEFINER, so the relay role needs no UPDATE on the outbox's keys.
-- Returns what it did: 'unchanged', 'continued' (the cluster changed, the key space did
-- not) or 'rebased', with the rows moved.
CREATE FUNCTION {schema}.outbox_check_key_space(
    OUT action text, OUT key_space uuid, OUT rebased_rows bigint, OUT detail text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    marker {schema}.outbox_key_space;
    system bigint;
    mine xid8;
    high xid8;
BEGIN
    SELECT * INTO marker FROM {schema}.outbox_key_space FOR UPDATE;  -- one check at a time
    SELECT system_identifier INTO system FROM pg_control_system();
    -- One snapshot for both: a row it sees committed before it was taken, so its key is
    -- at most the snapshot's xmax (docs/design.md). Above it: written elsewhere.
    SELECT greatest(marker.high_water,
                    (SELECT max(transaction_id) FROM {schema}.outbox),
                    (SELECT max(transaction_id) FROM {schema}.outbox_checkpoints)),
           pg_snapshot_xmax(pg_current_snapshot())
      INTO high, mine;
    key_space := marker.id;
    rebased_rows := 0;
    IF high > mine THEN
        rebased_rows := {schema}.outbox_rebase_keys(marker);
        action := 'rebased';
        detail := format('stored keys reach %s but this cluster is at %s', high, mine);
        SELECT id INTO key_space FROM {schema}.outbox_key_space;
    ELSIF system <> marker.system_identifier THEN
        action := 'continued';
        detail := format('cluster %s replaced %s; its ids (%s) are above every stored key (%s)',
                         system, marker.system_identifier, mine, high);
        UPDATE {schema}.outbox_key_space SET moved_high = high;
    ELSE
        action := 'unchanged';
    END IF;
    UPDATE {schema}.outbox_key_space
       SET system_identifier = system, high_water = mine, checked_at = now();
END
$$;

-- Gives every row copied from the old key space the key ('1', a fresh position), in the
-- old order: below every key this cluster can hand out (its ids start at 3), so the
-- copies are published first and in their order, and rows written here follow them.
-- Copies are told from rows written here by their inserting transaction: a restore
-- copies the table before any writer runs here, so a row not younger than the copies
-- that are certainly old (keys above this cluster's ids, and the lowest position, which
-- the restored sequence guarantees is old) is a copy.
CREATE FUNCTION {schema}.outbox_rebase_keys(marker {schema}.outbox_key_space)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    copied_age integer;
    moved bigint := 0;
    old_row record;
    new_position bigint;
    next_space uuid := gen_random_uuid();
BEGIN
    -- Writers wait (briefly) and their rows in flight are decided before we look.
    LOCK TABLE {schema}.outbox IN SHARE ROW EXCLUSIVE MODE;
    LOCK TABLE {schema}.outbox_checkpoints, {schema}.outbox_dead_letters IN EXCLUSIVE MODE;
    SELECT min(age(o.xmin)) INTO copied_age
      FROM {schema}.outbox o, pg_current_snapshot() AS s
     WHERE o.transaction_id > pg_snapshot_xmax(s)
        OR o.position = (SELECT min(position) FROM {schema}.outbox);
    FOR old_row IN
        SELECT o.transaction_id, o.position FROM {schema}.outbox o
         WHERE age(o.xmin) >= copied_age
         ORDER BY o.transaction_id, o.position
    LOOP
        -- An identity column takes only DEFAULT in an UPDATE: one row at a time keeps
        -- the fresh positions in the old order.
        UPDATE {schema}.outbox SET transaction_id = '1', position = DEFAULT
         WHERE transaction_id = old_row.transaction_id AND position = old_row.position
        RETURNING position INTO new_position;
        INSERT INTO {schema}.outbox_rebased_keys VALUES
            (marker.id, old_row.transaction_id, old_row.position, new_position);
        moved := moved + 1;
    END LOOP;
    -- Checkpoints (and where each generation started) move to the last copy at or
    -- before them; none: before every row.
    UPDATE {schema}.outbox_checkpoints c
       SET transaction_id = t.xid, position = t.pos,
           start_transaction_id = s.xid, start_position = s.pos,
           version = c.version + 1, updated_at = now()
      FROM {schema}.outbox_checkpoints old,
           LATERAL {schema}.outbox_translate_key(marker.id, old.transaction_id, old.position) t,
           LATERAL {schema}.outbox_translate_key(marker.id, old.start_transaction_id,
                                                 old.start_position) s
     WHERE c.subscriber = old.subscriber AND c.part = old.part;
    UPDATE {schema}.outbox_dead_letters d
       SET transaction_id = '1', position = r.position
      FROM {schema}.outbox_rebased_keys r
     WHERE r.from_key_space = marker.id
       AND (d.transaction_id, d.position) = (r.origin_transaction_id, r.origin_position);
    UPDATE {schema}.outbox_key_space
       SET id = next_space, previous_id = marker.id, moved_high = NULL,
           rebased_at = now(), rebased_rows = moved;
    RETURN moved;
END
$$;

-- A key of the key space ``from_space`` as a key of the one rebased from it: the last
-- rebased row at or before it ('0', 0 when there is none).
CREATE FUNCTION {schema}.outbox_translate_key(
    from_space uuid, at_transaction_id xid8, at_position bigint,
    OUT xid xid8, OUT pos bigint)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT CASE WHEN max(r.position) IS NULL THEN '0'::xid8 ELSE '1'::xid8 END,
           coalesce(max(r.position), 0)
      FROM {schema}.outbox_rebased_keys r
     WHERE r.from_key_space = from_space
       AND (r.origin_transaction_id, r.origin_position) <= (at_transaction_id, at_position);
END;

-- SECURITY DEFINER: only the roles `outbox-relay grant` names may call them.
REVOKE EXECUTE ON FUNCTION {schema}.outbox_check_key_space(),
    {schema}.outbox_rebase_keys({schema}.outbox_key_space),
    {schema}.outbox_translate_key(uuid, xid8, bigint) FROM PUBLIC;
