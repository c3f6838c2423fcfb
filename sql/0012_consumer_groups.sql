-- outbox-relay migration 0012: ordered consumer groups. A group's events are spread over a
-- fixed number of partition queues by key; each partition has one active consumer; a key's
-- events are applied one after another in the order the broker keeps. Everything that
-- decides lives in these functions, so a consumer in any language gets the same rules:
--
--   outbox_group_join      records the group's partition count once; refuses another one
--   outbox_group_beat      a member's heartbeat (database clock); returns the live members
--   outbox_group_leave     a member leaving on purpose
--   outbox_group_record    the inbox check of an ordered group: apply, jumped, duplicate, held
--   outbox_group_dead      records a dead-lettered event; blocks its key (block-key) or not
--   outbox_consumer_release  an operator lets a blocked key go on with its held events
--   outbox_group_releasable  keys with held events that may be applied now
--   outbox_group_take_held   the next held event of a key, recorded as the inbox check would
--
-- Errors a caller must tell apart carry their own SQLSTATE: 'OB002' a group started with a
-- partition count other than the one recorded.

-- One row per ordered group: its partition count, fixed for the life of the group (changing
-- it remaps keys to other partitions while old events still sit in the old ones).
CREATE TABLE outbox_consumer_groups (
    consumer   text PRIMARY KEY,
    partitions integer NOT NULL CHECK (partitions BETWEEN 1 AND 1000),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- The live members of each group: a member renews its lease every few seconds; one whose
-- lease ran out is deleted by the next heartbeat of any member, and the others take over its
-- partitions.
CREATE TABLE outbox_consumer_members (
    consumer    text NOT NULL,
    member      text NOT NULL,
    joined_at   timestamptz NOT NULL DEFAULT now(),
    lease_until timestamptz NOT NULL,
    PRIMARY KEY (consumer, member)
);

-- A key blocked after one of its events was dead-lettered (policy block-key): which seq,
-- since when, why. NULL: not blocked.
ALTER TABLE outbox_inbox_keys
    ADD COLUMN blocked_seq bigint,
    ADD COLUMN blocked_at timestamptz,
    ADD COLUMN blocked_reason text;

-- Events of a blocked key that arrived after the dead one, moved out of the partition queue
-- (so they do not hold its prefetch window) and applied in seq order once the key is
-- released. A row is deleted in the transaction that applies (or dead-letters) it.
CREATE TABLE outbox_inbox_held (
    consumer       text NOT NULL,
    partition      integer NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    seq            bigint NOT NULL,
    event_id       uuid NOT NULL,
    event_type     text,
    routing_key    text NOT NULL,
    headers        jsonb NOT NULL DEFAULT '{}',
    body           bytea NOT NULL,
    held_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id, seq)
);
CREATE INDEX outbox_inbox_held_partition ON outbox_inbox_held (consumer, partition);

-- A seq jump is recorded, not waited for: in a consumer group a key's events reach its
-- partition queue in seq order, so a missing seq was parked upstream or never routed here.
ALTER TABLE outbox_inbox_gaps DROP CONSTRAINT outbox_inbox_gaps_action_check;
ALTER TABLE outbox_inbox_gaps ADD CONSTRAINT outbox_inbox_gaps_action_check
    CHECK (action IN ('skipped', 'dead', 'jumped'));

---------------------------------------------------------------------------------------------
-- Membership

-- Records the group's partition count the first time; afterwards the same count must be
-- asked for, or 'OB002' is raised (the group keeps its count: drain it before changing it).
CREATE FUNCTION outbox_group_join(p_consumer text, p_partitions integer) RETURNS integer
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    v_recorded integer;
BEGIN
    INSERT INTO outbox_consumer_groups (consumer, partitions) VALUES (p_consumer, p_partitions)
    ON CONFLICT DO NOTHING;
    SELECT g.partitions INTO v_recorded FROM outbox_consumer_groups g WHERE g.consumer = p_consumer;
    IF v_recorded <> p_partitions THEN
        RAISE EXCEPTION 'consumer group % has % partitions, not %: changing the count maps keys to other partitions while their earlier events still wait in the old ones, so two consumers would apply one key at once; drain the group and delete its row in outbox_consumer_groups first (docs/consumer-kit.md, "Changing the partition count")',
                        p_consumer, v_recorded, p_partitions
            USING ERRCODE = 'OB002',
                  DETAIL = jsonb_build_object('consumer', p_consumer, 'recorded', v_recorded,
                                              'asked', p_partitions)::text;
    END IF;
    RETURN v_recorded;
END
$$;

-- A member's heartbeat: renews its lease (database clock), forgets members whose lease ran
-- out, and returns the live members in sorted order. Member i of n owns the partitions p
-- with p % n = i.
CREATE FUNCTION outbox_group_beat(p_consumer text, p_member text, p_lease_ms integer)
RETURNS SETOF text
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    DELETE FROM outbox_consumer_members m
     WHERE m.consumer = p_consumer AND m.lease_until < clock_timestamp();
    INSERT INTO outbox_consumer_members AS m (consumer, member, lease_until)
    VALUES (p_consumer, p_member, clock_timestamp() + make_interval(secs => p_lease_ms / 1000.0))
    ON CONFLICT (consumer, member) DO UPDATE SET lease_until = excluded.lease_until;
    RETURN QUERY SELECT m.member FROM outbox_consumer_members m
                  WHERE m.consumer = p_consumer ORDER BY m.member COLLATE "C";
END
$$;

CREATE FUNCTION outbox_group_leave(p_consumer text, p_member text) RETURNS void
LANGUAGE sql SET search_path FROM CURRENT
AS $$
    DELETE FROM outbox_consumer_members WHERE consumer = p_consumer AND member = p_member
$$;

---------------------------------------------------------------------------------------------
-- The inbox of an ordered group

-- Call first in the handler's transaction, for every delivery of a partition queue, in the
-- order the queue delivers a key's events. Returns
--   'apply'     new and next: run the handler, commit, ack;
--   'jumped'    new, with seqs before it never seen (parked upstream, or routed elsewhere):
--               recorded in outbox_inbox_gaps; run the handler, commit, ack;
--   'duplicate' already applied or dead-lettered, or older than the key: commit, ack;
--   'held'      the key is blocked, or still has held events: the event was stored in
--               outbox_inbox_held; commit, ack (it is applied after the key's release).
-- last_seq is the key's last applied seq before this call. A concurrent call for the same
-- key waits on the key's row lock.
CREATE FUNCTION outbox_group_record(
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
    IF p_seq <= k.last_seq OR EXISTS (
        SELECT 1 FROM outbox_inbox i WHERE i.consumer = p_consumer AND i.event_id = p_event_id
    ) THEN
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

-- Records the event as applied and moves its key to p_seq (the caller holds the key's row
-- lock); a jump over missing seqs is recorded. Returns 'apply' or 'jumped'.
CREATE FUNCTION outbox_group_advance(
    p_consumer text,
    p_event_id uuid,
    p_aggregate_type text,
    p_aggregate_id text,
    p_seq bigint,
    p_last bigint
) RETURNS text
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    INSERT INTO outbox_inbox (consumer, event_id, aggregate_type, aggregate_id, seq)
    VALUES (p_consumer, p_event_id, p_aggregate_type, p_aggregate_id, p_seq);
    UPDATE outbox_inbox_keys ik SET last_seq = p_seq, updated_at = now()
     WHERE ik.consumer = p_consumer AND ik.aggregate_type = p_aggregate_type
       AND ik.aggregate_id = p_aggregate_id;
    IF p_seq > p_last + 1 THEN
        INSERT INTO outbox_inbox_gaps
            (consumer, aggregate_type, aggregate_id, expected_seq, got_seq, event_id, action)
        VALUES (p_consumer, p_aggregate_type, p_aggregate_id, p_last + 1, p_seq, p_event_id, 'jumped');
        RETURN 'jumped';
    END IF;
    RETURN 'apply';
END
$$;

-- Records an event sent to the dead-letter exchange (after the broker confirmed the copy):
-- later copies are duplicates, the key moves past it, a held copy of it is deleted, and with
-- p_block the key is blocked at it: its later events are held until outbox_consumer_release.
CREATE FUNCTION outbox_group_dead(
    p_consumer text,
    p_event_id uuid,
    p_aggregate_type text,
    p_aggregate_id text,
    p_seq bigint,
    p_reason text,
    p_block boolean
) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    INSERT INTO outbox_inbox (consumer, event_id, aggregate_type, aggregate_id, seq, outcome, reason)
    VALUES (p_consumer, p_event_id, p_aggregate_type, p_aggregate_id, p_seq, 'dead', p_reason)
    ON CONFLICT (consumer, event_id) DO UPDATE SET outcome = 'dead', reason = excluded.reason;
    INSERT INTO outbox_inbox_keys AS k (consumer, aggregate_type, aggregate_id, last_seq)
    VALUES (p_consumer, p_aggregate_type, p_aggregate_id, p_seq)
    ON CONFLICT (consumer, aggregate_type, aggregate_id)
    DO UPDATE SET last_seq = greatest(k.last_seq, excluded.last_seq), updated_at = now();
    DELETE FROM outbox_inbox_held h
     WHERE h.consumer = p_consumer AND h.aggregate_type = p_aggregate_type
       AND h.aggregate_id = p_aggregate_id AND h.seq = p_seq;
    IF p_block THEN
        UPDATE outbox_inbox_keys k
           SET blocked_seq = p_seq, blocked_at = now(), blocked_reason = p_reason
         WHERE k.consumer = p_consumer AND k.aggregate_type = p_aggregate_type
           AND k.aggregate_id = p_aggregate_id;
    END IF;
END
$$;

-- An operator lets a blocked key go on: the dead event stays dead-lettered (with its record
-- in outbox_inbox); the key's held events are applied in seq order by the member that owns
-- its partition, before any newer event of the key. Returns how many events were held.
-- NULL: the key was not blocked (nothing changed).
CREATE FUNCTION outbox_consumer_release(p_consumer text, p_aggregate_type text, p_aggregate_id text)
RETURNS bigint
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    v_blocked bigint;
BEGIN
    SELECT k.blocked_seq INTO v_blocked FROM outbox_inbox_keys k
     WHERE k.consumer = p_consumer AND k.aggregate_type = p_aggregate_type
       AND k.aggregate_id = p_aggregate_id
       FOR UPDATE;
    IF v_blocked IS NULL THEN
        RETURN NULL;
    END IF;
    UPDATE outbox_inbox_keys k SET blocked_seq = NULL, blocked_at = NULL, blocked_reason = NULL,
                                   updated_at = now()
     WHERE k.consumer = p_consumer AND k.aggregate_type = p_aggregate_type
       AND k.aggregate_id = p_aggregate_id;
    RETURN (SELECT count(*) FROM outbox_inbox_held h
             WHERE h.consumer = p_consumer AND h.aggregate_type = p_aggregate_type
               AND h.aggregate_id = p_aggregate_id);
END
$$;

-- Keys of the given partitions that have held events and are not blocked (released, or
-- never blocked: events held behind an earlier held one).
CREATE FUNCTION outbox_group_releasable(p_consumer text, p_partitions integer[])
RETURNS TABLE (aggregate_type text, aggregate_id text)
LANGUAGE sql STABLE SET search_path FROM CURRENT
AS $$
    SELECT DISTINCT h.aggregate_type, h.aggregate_id
      FROM outbox_inbox_held h
      JOIN outbox_inbox_keys k ON k.consumer = h.consumer
       AND k.aggregate_type = h.aggregate_type AND k.aggregate_id = h.aggregate_id
     WHERE h.consumer = p_consumer AND h.partition = ANY (p_partitions)
       AND k.blocked_seq IS NULL
$$;

-- Call first in the transaction that applies a released key's next held event: takes the
-- lowest held seq of the key (none while it is blocked), deletes it and records it as
-- outbox_group_record would ('apply', 'jumped' or 'duplicate'). Run the handler on the
-- returned event for 'apply'/'jumped', then commit; a rollback leaves it held.
CREATE FUNCTION outbox_group_take_held(p_consumer text, p_aggregate_type text, p_aggregate_id text)
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
    DELETE FROM outbox_inbox_held hh
     WHERE hh.consumer = p_consumer AND hh.aggregate_type = p_aggregate_type
       AND hh.aggregate_id = p_aggregate_id AND hh.seq = h.seq;
    IF h.seq <= k.last_seq OR EXISTS (
        SELECT 1 FROM outbox_inbox i WHERE i.consumer = p_consumer AND i.event_id = h.event_id
    ) THEN
        v_outcome := 'duplicate';
    ELSE
        v_outcome := outbox_group_advance(p_consumer, h.event_id, p_aggregate_type,
                                          p_aggregate_id, h.seq, k.last_seq);
    END IF;
    RETURN QUERY SELECT v_outcome, h.event_id, h.seq, h.event_type, h.routing_key, h.headers,
                        h.body, h.partition;
END
$$;
