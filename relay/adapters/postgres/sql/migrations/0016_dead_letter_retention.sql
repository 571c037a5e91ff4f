-- Dead letters under retention (issue #47): a dead letter not yet redriven keeps its
-- outbox row, which `dead-letters redrive` publishes, past the outbox's retention. (It
-- used to be pruned with the published rows: the dead letter could no longer be
-- redriven.) Redriven dead letters go once their row is pruned; those not redriven,
-- only when the operator says so (`dead-letters prune`, `dead_letter_retention`).

-- The outbox's retention looks up each row it would delete here.
CREATE INDEX outbox_dead_letters_pending
    ON {schema}.outbox_dead_letters (transaction_id, position) WHERE redriven_at IS NULL;

CREATE OR REPLACE FUNCTION {schema}.outbox_prune(older_than_s double precision, batch_size integer)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    bound record;
    deleted bigint;
BEGIN
    IF older_than_s IS NULL OR older_than_s < 0 OR batch_size IS NULL OR batch_size < 1 THEN
        RAISE EXCEPTION 'outbox_prune: older_than_s must be >= 0 and batch_size >= 1'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The oldest part checkpoint of all subscribers: every row at or before it is
    -- published for everyone (none when there is no subscriber: prune nothing).
    SELECT c.transaction_id, c.position INTO bound FROM {schema}.outbox_checkpoints c
     ORDER BY c.transaction_id, c.position
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    WITH doomed AS (
        SELECT o.ctid FROM {schema}.outbox o
         WHERE (o.transaction_id, o.position) <= (bound.transaction_id, bound.position)
           AND o.occurred_at < pg_catalog.now() - pg_catalog.make_interval(secs => older_than_s)
           AND (o.aggregate_version IS NULL OR EXISTS (
                 SELECT 1 FROM {schema}.outbox n
                  WHERE n.aggregate_type = o.aggregate_type AND n.aggregate_id = o.aggregate_id
                    AND n.aggregate_version = o.aggregate_version + 1))
           -- A dead letter not yet redriven: redrive reads its event here.
           AND NOT EXISTS (
                 SELECT 1 FROM {schema}.outbox_dead_letters d
                  WHERE d.transaction_id = o.transaction_id AND d.position = o.position
                    AND d.redriven_at IS NULL)
         ORDER BY o.transaction_id, o.position
         LIMIT batch_size
    )
    DELETE FROM {schema}.outbox WHERE ctid IN (SELECT ctid FROM doomed);
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;
