-- Event ids default to UUIDv7 (RFC 9562): a millisecond timestamp first, then random bits.
--
-- Each update of a row (its claim, its mark) is a new row version with a new entry in every
-- index, the unique index on event_id included. With random (v4) ids those entries land on
-- random leaf pages; once the table outgrows shared_buffers nearly each one is a read from
-- outside it (the benchmark's growth run with 5 million dispatched rows: 27 times more
-- index reads than on an empty table, and a drain at 0.72 of its rate). Time-ordered ids
-- put the entries of recent rows, the only ones being updated, side by side.
--
-- Producers may still pass any uuid of their own.
CREATE FUNCTION outbox_uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),  -- version 4 (0100) becomes 7 (0111)
        'hex')::uuid
$$;

ALTER TABLE outbox_events ALTER COLUMN event_id SET DEFAULT outbox_uuid_v7();
