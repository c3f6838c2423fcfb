-- Events that arrive after a later event of their key are recorded, not dropped silently.
--
-- In an ordered consumer group a key's events reach its partition queue in seq order, so an
-- event older than its key's last applied seq was taken for a duplicate and acked. That holds
-- only while the key stays on one partition. If it ever moved while older events still waited
-- in the old partition (a soak with 16 RabbitMQ node restarts under deep backlogs saw a key's
-- seq 362 applied before 143-361), those older events were acked as duplicates, never applied,
-- and nothing said so. Now an event older than its key that the inbox has never seen (its id
-- is not in outbox_inbox) is recorded in outbox_inbox_gaps with action 'late' and still
-- acked ('duplicate': it cannot be applied in order any more). An operator, or a check such
-- as the soak's verdict, sees every such event. A true duplicate (its id in the inbox) is
-- not recorded. A duplicate of an event whose inbox row was already pruned by retention
-- would be recorded as 'late' too: a false alarm, never a loss.

ALTER TABLE outbox_inbox_gaps DROP CONSTRAINT outbox_inbox_gaps_action_check;
ALTER TABLE outbox_inbox_gaps ADD CONSTRAINT outbox_inbox_gaps_action_check
    CHECK (action IN ('skipped', 'dead', 'jumped', 'late'));

-- Same arguments and result: replaced in place, keeps its grants.
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
    IF k.blocked_seq IS NOT NULL OR EXISTS (
        SELECT 1 FROM outbox_inbox_held h
         WHERE h.consumer = p_consumer AND h.aggregate_type = p_aggregate_type
           AND h.aggregate_id = p_aggregate_id
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
