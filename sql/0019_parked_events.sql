-- An ordered group parks a failing key's later events in the database, so that one key never
-- holds its partition's prefetch window.
--
-- A partition queue is consumed with a prefetch: at most that many of its events are unacked
-- in the member's hand. A key's events wait in memory behind the one that runs; when that one
-- keeps failing and its key has as many events queued behind it as the prefetch, the window is
-- full of that key and no other key of the partition gets a delivery (measured: prefetch 8,
-- key A failing with 24 of its events behind it, 20 events of key B behind those: none of B
-- applied in 30 s). Now a member keeps only a few of a key's events in memory behind the one
-- that runs and parks the rest: outbox_group_park stores each in outbox_inbox_held with the
-- highest seq of the key the member still had unacked in hand (outbox_inbox_held.parked_after),
-- and the member acks it. Every event of the key that was unacked and older than the parked
-- one is at or below that seq (a partition queue delivers a key's events in seq order), so a
-- parked row waits until the key's last_seq reaches its parked_after, then is applied in seq
-- order like a released key's held events. An event is held only behind a held event with a
-- lower seq (or while its key is blocked): an earlier event still in a partition queue or in a
-- member's hand is applied before the parked ones, a later one waits behind them.
--
-- Also: outbox_group_take_held records a held event its key already went past as 'late' in
-- outbox_inbox_gaps (before, it was taken for a duplicate with no record).
--
-- Replaced in place with the same arguments and results (grants kept): outbox_group_record,
-- outbox_group_releasable, outbox_group_take_held. New: outbox_group_park.

ALTER TABLE outbox_inbox_held ADD COLUMN parked_after bigint;

COMMENT ON COLUMN outbox_inbox_held.parked_after IS
    'a parked event: the highest seq of its key still unacked in the member''s hand when it was parked; it is applied once the key''s last_seq reaches it (NULL: held behind a blocked key or an earlier held event)';

CREATE OR REPLACE FUNCTION outbox_group_record(
    p_consumer text,
    p_partition integer,
    p_event_id uuid,
    p_aggregate_type text,
    p_aggregate_id text,
    p_seq bigint,
    p_event_type text,
    p_routing_key text,
    p_headers jsonb,
    p_body bytea
) RETURNS TABLE (outcome text, last_seq bigint)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    k outbox_inbox_keys%ROWTYPE;
BEGIN
    IF p_seq IS NULL OR p_seq < 1 THEN
        RAISE EXCEPTION 'an ordered consumer group needs the event''s seq (x-outbox-seq), got %', p_seq
            USING ERRCODE = '22023';
    END IF;
    INSERT INTO outbox_inbox_keys (consumer, aggregate_type, aggregate_id)
    VALUES (p_consumer, p_aggregate_type, p_aggregate_id)
    ON CONFLICT DO NOTHING;
    SELECT * INTO k FROM outbox_inbox_keys ik
     WHERE ik.consumer = p_consumer AND ik.aggregate_type = p_aggregate_type
       AND ik.aggregate_id = p_aggregate_id
       FOR UPDATE;
    IF EXISTS (
        SELECT 1 FROM outbox_inbox i WHERE i.consumer = p_consumer AND i.event_id = p_event_id
    ) THEN
        RETURN QUERY SELECT 'duplicate'::text, k.last_seq;
        RETURN;
    END IF;
    IF p_seq <= k.last_seq THEN
        -- Older than the key but never seen: it came after a later event of its key, so it
        -- cannot be applied in order. Recorded (once per event), never silently dropped.
        INSERT INTO outbox_inbox_gaps
            (consumer, aggregate_type, aggregate_id, expected_seq, got_seq, event_id, action)
        SELECT p_consumer, p_aggregate_type, p_aggregate_id, k.last_seq + 1, p_seq, p_event_id, 'late'
         WHERE NOT EXISTS (SELECT 1 FROM outbox_inbox_gaps g
                            WHERE g.consumer = p_consumer AND g.event_id = p_event_id
                              AND g.action = 'late');
        RETURN QUERY SELECT 'duplicate'::text, k.last_seq;
        RETURN;
    END IF;
    -- Held: the key is blocked, or has a held event with a lower seq to wait behind. An
    -- event below every held one was still unacked when its key's later events were parked:
    -- it goes before them.
    IF k.blocked_seq IS NOT NULL OR EXISTS (
        SELECT 1 FROM outbox_inbox_held h
         WHERE h.consumer = p_consumer AND h.aggregate_type = p_aggregate_type
           AND h.aggregate_id = p_aggregate_id AND h.seq < p_seq
    ) THEN
        INSERT INTO outbox_inbox_held (consumer, partition, aggregate_type, aggregate_id, seq,
                                       event_id, event_type, routing_key, headers, body)
        VALUES (p_consumer, p_partition, p_aggregate_type, p_aggregate_id, p_seq,
                p_event_id, p_event_type, p_routing_key, coalesce(p_headers, '{}'), p_body)
        ON CONFLICT DO NOTHING;
        RETURN QUERY SELECT 'held'::text, k.last_seq;
        RETURN;
    END IF;
    RETURN QUERY SELECT outbox_group_advance(p_consumer, p_event_id, p_aggregate_type,
                                             p_aggregate_id, p_seq, k.last_seq), k.last_seq;
END
$$;

-- Parks a delivered event of a key whose earlier events are still unacked in the caller's
-- hand, up to seq p_after: stores it in outbox_inbox_held, where it waits until the key has
-- applied (or dead-lettered) every seq up to p_after. Returns 'parked' (ack the delivery), or
-- what outbox_group_record says about an event the key already has ('duplicate', recorded as
-- late when it was never seen).
CREATE FUNCTION outbox_group_park(
    p_consumer text,
    p_partition integer,
    p_event_id uuid,
    p_aggregate_type text,
    p_aggregate_id text,
    p_seq bigint,
    p_event_type text,
    p_routing_key text,
    p_headers jsonb,
    p_body bytea,
    p_after bigint
) RETURNS text
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    k outbox_inbox_keys%ROWTYPE;
BEGIN
    IF p_seq IS NULL OR p_after IS NULL OR p_seq <= p_after THEN
        RAISE EXCEPTION 'a parked event''s seq (%) must be above the seq it waits for (%)', p_seq, p_after
            USING ERRCODE = '22023';
    END IF;
    INSERT INTO outbox_inbox_keys (consumer, aggregate_type, aggregate_id)
    VALUES (p_consumer, p_aggregate_type, p_aggregate_id)
    ON CONFLICT DO NOTHING;
    SELECT * INTO k FROM outbox_inbox_keys ik
     WHERE ik.consumer = p_consumer AND ik.aggregate_type = p_aggregate_type
       AND ik.aggregate_id = p_aggregate_id
       FOR UPDATE;
    IF p_seq <= k.last_seq OR EXISTS (
        SELECT 1 FROM outbox_inbox i WHERE i.consumer = p_consumer AND i.event_id = p_event_id
    ) THEN
        RETURN (SELECT r.outcome FROM outbox_group_record(p_consumer, p_partition, p_event_id,
                    p_aggregate_type, p_aggregate_id, p_seq, p_event_type, p_routing_key,
                    p_headers, p_body) r);
    END IF;
    INSERT INTO outbox_inbox_held (consumer, partition, aggregate_type, aggregate_id, seq,
                                   event_id, event_type, routing_key, headers, body, parked_after)
    VALUES (p_consumer, p_partition, p_aggregate_type, p_aggregate_id, p_seq,
            p_event_id, p_event_type, p_routing_key, coalesce(p_headers, '{}'), p_body, p_after)
    ON CONFLICT DO NOTHING;
    RETURN 'parked';
END
$$;

-- Keys of the given partitions that have held events which may be applied now: not blocked,
-- and their first held event not parked behind events still unapplied.
CREATE OR REPLACE FUNCTION outbox_group_releasable(p_consumer text, p_partitions integer[])
RETURNS TABLE (aggregate_type text, aggregate_id text)
LANGUAGE sql STABLE SET search_path FROM CURRENT
AS $$
    SELECT DISTINCT h.aggregate_type, h.aggregate_id
      FROM outbox_inbox_held h
      JOIN outbox_inbox_keys k ON k.consumer = h.consumer
       AND k.aggregate_type = h.aggregate_type AND k.aggregate_id = h.aggregate_id
     WHERE h.consumer = p_consumer AND h.partition = ANY (p_partitions)
       AND k.blocked_seq IS NULL
       AND (h.parked_after IS NULL OR k.last_seq >= h.parked_after)
       AND NOT EXISTS (SELECT 1 FROM outbox_inbox_held e
                        WHERE e.consumer = h.consumer AND e.aggregate_type = h.aggregate_type
                          AND e.aggregate_id = h.aggregate_id AND e.seq < h.seq)
$$;

-- As before, and a parked event is not taken before the key's last_seq reached its
-- parked_after (the events unacked before it are applied first); a held event its key
-- already went past is recorded as late, as outbox_group_record does since 0014.
CREATE OR REPLACE FUNCTION outbox_group_take_held(p_consumer text, p_aggregate_type text, p_aggregate_id text)
RETURNS TABLE (outcome text, event_id uuid, seq bigint, event_type text, routing_key text,
               headers jsonb, body bytea, partition integer)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    k outbox_inbox_keys%ROWTYPE;
    h outbox_inbox_held%ROWTYPE;
    v_outcome text;
BEGIN
    SELECT * INTO k FROM outbox_inbox_keys ik
     WHERE ik.consumer = p_consumer AND ik.aggregate_type = p_aggregate_type
       AND ik.aggregate_id = p_aggregate_id
       FOR UPDATE;
    IF NOT FOUND OR k.blocked_seq IS NOT NULL THEN
        RETURN;
    END IF;
    SELECT * INTO h FROM outbox_inbox_held hh
     WHERE hh.consumer = p_consumer AND hh.aggregate_type = p_aggregate_type
       AND hh.aggregate_id = p_aggregate_id
     ORDER BY hh.seq LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF h.parked_after IS NOT NULL AND k.last_seq < h.parked_after THEN
        RETURN;
    END IF;
    DELETE FROM outbox_inbox_held hh
     WHERE hh.consumer = p_consumer AND hh.aggregate_type = p_aggregate_type
       AND hh.aggregate_id = p_aggregate_id AND hh.seq = h.seq;
    IF EXISTS (
        SELECT 1 FROM outbox_inbox i WHERE i.consumer = p_consumer AND i.event_id = h.event_id
    ) THEN
        v_outcome := 'duplicate';
    ELSIF h.seq <= k.last_seq THEN
        -- Held, and its key went past it meanwhile (a later event dead-lettered with
        -- continue, or applied): never seen, so recorded as late, as outbox_group_record
        -- records such an event (0014), never dropped silently.
        INSERT INTO outbox_inbox_gaps
            (consumer, aggregate_type, aggregate_id, expected_seq, got_seq, event_id, action)
        SELECT p_consumer, p_aggregate_type, p_aggregate_id, k.last_seq + 1, h.seq, h.event_id, 'late'
         WHERE NOT EXISTS (SELECT 1 FROM outbox_inbox_gaps g
                            WHERE g.consumer = p_consumer AND g.event_id = h.event_id
                              AND g.action = 'late');
        v_outcome := 'duplicate';
    ELSE
        v_outcome := outbox_group_advance(p_consumer, h.event_id, p_aggregate_type,
                                          p_aggregate_id, h.seq, k.last_seq);
    END IF;
    RETURN QUERY SELECT v_outcome, h.event_id, h.seq, h.event_type, h.routing_key, h.headers,
                        h.body, h.partition;
END
$$;

-- outbox_group_park is new in the public contract (docs/contract.md): its version is 19.
CREATE OR REPLACE FUNCTION outbox_contract_version() RETURNS integer
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT 19 $$;
