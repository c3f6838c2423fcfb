-- outbox-relay migration 0020: a consumer's attempts at an event are counted in the database,
-- so an event that kills its member is dead-lettered; a dead event without a usable seq still
-- blocks its key; held events of a group whose partition count changed are drained.
--
-- 1. outbox_inbox_attempt. Before, the attempts of an event lived in the member's memory: an
--    event that aborted its process (out of memory, a stack overflow, `panic = "abort"`) was
--    redelivered to the next owner with its count back at zero, and killed each owner in turn.
--    Now a consumer counts every attempt that cannot count in memory (a redelivered event's,
--    and each retry in place) in outbox_inbox_attempts, committed before the handler runs; a
--    delivery whose event already had max_attempts is dead-lettered without running. The first
--    attempt of a first delivery is not recorded (the fast path writes nothing more), so the
--    count of an event is the number of its attempts before the one about to run.
-- 2. outbox_group_dead takes a NULL seq: an event whose seq header could not be read (but with
--    its id and key) is recorded dead, and with p_block its key is blocked at its next seq, so
--    the key's later events are held, not applied as a jump past it.
-- 3. outbox_group_join re-homes held rows whose partition is at or above the group's count
--    (a group drained of everything but held events, deleted and started again with fewer
--    partitions): partition p becomes p % count, owned by a member that drains it. Any member
--    may drain a key's held events: the inbox applies them in seq order under the key's lock.
-- 4. outbox_consumer_prune also deletes attempt rows last counted before p_before.
--
-- Replaced in place with the same arguments and results (grants kept): outbox_group_dead,
-- outbox_group_join, outbox_consumer_prune. New: outbox_inbox_attempt (public) and the table
-- outbox_inbox_attempts (re-apply sql/roles.sql to grant it, and UPDATE of
-- outbox_inbox_held.partition, to the consumer role).

CREATE TABLE outbox_inbox_attempts (
    consumer text NOT NULL,
    event_id uuid NOT NULL,
    attempts integer NOT NULL DEFAULT 1,
    first_at timestamptz NOT NULL DEFAULT now(),
    last_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

COMMENT ON TABLE outbox_inbox_attempts IS
    'attempts of an event a consumer counted before running them (redeliveries, retries in place); written by outbox_inbox_attempt, deleted by outbox_consumer_prune';

-- Counts one more attempt of the event (commit it before the attempt runs) and returns the
-- count: how many attempts the event had before this one, counting the unrecorded first
-- attempt of its first delivery. Dead-letter instead of running when it reaches max_attempts.
CREATE FUNCTION outbox_inbox_attempt(p_consumer text, p_event_id uuid) RETURNS integer
LANGUAGE sql SET search_path FROM CURRENT
AS $$
    INSERT INTO outbox_inbox_attempts AS a (consumer, event_id) VALUES (p_consumer, p_event_id)
    ON CONFLICT (consumer, event_id) DO UPDATE SET attempts = a.attempts + 1, last_at = now()
    RETURNING a.attempts
$$;

-- As in 0012, and a NULL p_seq (the event's seq could not be read): the event is recorded
-- dead, its key does not move, and with p_block the key is blocked at its next seq.
CREATE OR REPLACE FUNCTION outbox_group_dead(
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
    VALUES (p_consumer, p_aggregate_type, p_aggregate_id, coalesce(p_seq, 0))
    ON CONFLICT (consumer, aggregate_type, aggregate_id)
    DO UPDATE SET last_seq = greatest(k.last_seq, excluded.last_seq), updated_at = now();
    DELETE FROM outbox_inbox_held h
     WHERE h.consumer = p_consumer AND h.aggregate_type = p_aggregate_type
       AND h.aggregate_id = p_aggregate_id AND h.seq = p_seq;
    IF p_block THEN
        UPDATE outbox_inbox_keys k
           SET blocked_seq = coalesce(p_seq, k.last_seq + 1), blocked_at = now(),
               blocked_reason = p_reason
         WHERE k.consumer = p_consumer AND k.aggregate_type = p_aggregate_type
           AND k.aggregate_id = p_aggregate_id;
    END IF;
END
$$;

-- As in 0012, and held rows of partitions the count no longer has are re-homed (p % count).
CREATE OR REPLACE FUNCTION outbox_group_join(p_consumer text, p_partitions integer) RETURNS integer
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
    -- Only when there is something to move: a role that roles.sql of an earlier version
    -- granted no UPDATE on outbox_inbox_held still joins.
    IF EXISTS (SELECT 1 FROM outbox_inbox_held h
                WHERE h.consumer = p_consumer AND h.partition >= v_recorded) THEN
        UPDATE outbox_inbox_held h SET partition = h.partition % v_recorded
         WHERE h.consumer = p_consumer AND h.partition >= v_recorded;
    END IF;
    RETURN v_recorded;
END
$$;

-- As in 0003, and attempt rows last counted before p_before are deleted too (up to p_limit,
-- not in the counts returned).
CREATE OR REPLACE FUNCTION outbox_consumer_prune(p_before timestamptz, p_limit integer)
RETURNS TABLE (effects_deleted bigint, inbox_deleted bigint)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
DECLARE
    v_effects bigint;
    v_inbox bigint;
BEGIN
    WITH d AS (
        DELETE FROM outbox_effects e
         WHERE e.id IN (SELECT x.id FROM outbox_effects x
                         WHERE x.state IN ('sent', 'failed', 'cancelled') AND x.updated_at < p_before
                         ORDER BY x.updated_at LIMIT p_limit
                           FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT count(*) INTO v_effects FROM d;
    WITH d AS (
        DELETE FROM outbox_inbox i
         WHERE (i.consumer, i.event_id) IN (
               SELECT x.consumer, x.event_id FROM outbox_inbox x
                WHERE x.handled_at < p_before
                ORDER BY x.handled_at LIMIT p_limit
                  FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT count(*) INTO v_inbox FROM d;
    DELETE FROM outbox_inbox_attempts a
     WHERE (a.consumer, a.event_id) IN (
           SELECT x.consumer, x.event_id FROM outbox_inbox_attempts x
            WHERE x.last_at < p_before
            LIMIT p_limit
              FOR UPDATE SKIP LOCKED);
    RETURN QUERY SELECT v_effects, v_inbox;
END
$$;

-- outbox_inbox_attempt is new in the public contract (docs/contract.md): its version is 20.
CREATE OR REPLACE FUNCTION outbox_contract_version() RETURNS integer
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT 20 $$;
