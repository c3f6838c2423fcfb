-- Replay: `outbox-relay replay` re-publishes retained, dispatched events to one queue.
--
-- outbox_replays: one row per named replay, its selection and how far it got. The selection
-- is fixed when the replay starts (a `--since 1h` does not move on a resume); `last_id` is
-- the id up to which every selected row was confirmed by the broker, written after each
-- batch's confirms, so a replay that crashed or was stopped resumes after it. A crash
-- between the confirms and that write re-publishes the batch: consumers dedupe replayed
-- events by message_id like any redelivery.
CREATE TABLE outbox_replays (
    name           text PRIMARY KEY,
    queue          text NOT NULL,
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    created_from   timestamptz,
    created_before timestamptz,
    from_id        bigint,
    to_id          bigint,
    -- The highest id the replay covers: the newest row when it started (or --to-id).
    upper_id       bigint NOT NULL,
    last_id        bigint NOT NULL,
    total          bigint NOT NULL,
    published      bigint NOT NULL DEFAULT 0,
    started_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz
);

-- outbox_retention_horizon: what has been deleted of the dispatched rows (by --retention or
-- by hand), so a replay can refuse a range that reaches into it and say how much is gone.
-- One row, written by a statement-level trigger once per DELETE statement that removed
-- dispatched rows (a retention batch: one upsert per 5000 rows), never per row.
CREATE TABLE outbox_retention_horizon (
    only_row       boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    -- The highest id of a dispatched row deleted so far.
    deleted_to_id  bigint NOT NULL,
    -- The latest created_at of a dispatched row deleted so far.
    deleted_to_created_at timestamptz NOT NULL,
    -- How many dispatched rows have been deleted in all.
    deleted_rows   bigint NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION outbox_record_deleted() RETURNS trigger
    LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO outbox_retention_horizon AS h (deleted_to_id, deleted_to_created_at, deleted_rows)
    SELECT max(g.id), max(g.created_at), count(*)
      FROM outbox_deleted g
     WHERE g.dispatched_at IS NOT NULL
    HAVING count(*) > 0
    ON CONFLICT (only_row) DO UPDATE
       SET deleted_to_id = greatest(h.deleted_to_id, excluded.deleted_to_id),
           deleted_to_created_at = greatest(h.deleted_to_created_at, excluded.deleted_to_created_at),
           deleted_rows = h.deleted_rows + excluded.deleted_rows,
           updated_at = now();
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_events_deleted
    AFTER DELETE ON outbox_events
    REFERENCING OLD TABLE AS outbox_deleted
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_record_deleted();
