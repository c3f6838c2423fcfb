-- Failure and park writes are fenced on the lease, a retried park is told apart from a row
-- someone else finished, a re-driven row never takes a number already published, and the
-- one SECURITY DEFINER function cannot be steered by the caller's temporary objects.
--
-- outbox_record_failures took no lease: a relay whose lease had lapsed could still park or
-- rewind a key its new owner was publishing, or park a row the new owner had delivered
-- (that owner's mark then changed nothing, and a re-drive sent the event twice). It now
-- takes the relay's id and the (partition, epoch) pairs it holds, waits for running lease
-- takeovers like a claim does (the claim lock, shared), and touches only rows of partitions
-- this relay still owns at those epochs with a lease that has not run out.
--
-- It also returned nothing for a row it did not change, so a relay whose park committed
-- but whose round trip failed (connection dropped after COMMIT, deadline) retried, got
-- nothing back and carried the key on as if the row were gone: with --on-park block-key
-- the key's later rows went out with numbers the park had rewound, and were numbered again
-- after a re-drive (two events with one seq). Every id now comes back with an outcome:
-- 'recorded' (this call), 'parked' (parked already: an earlier call of ours), 'dispatched',
-- 'fenced' (not this relay's partition any more) or 'gone'.
--
-- The old signature is dropped (an unfenced write must not stay callable); its grants carry
-- over to the new one.

CREATE TEMPORARY TABLE outbox_failures_acl ON COMMIT DROP AS
    SELECT proacl FROM pg_proc
     WHERE oid = 'outbox_record_failures(bigint[], text[], smallint[], integer, boolean)'::regprocedure;

DROP FUNCTION outbox_record_failures(bigint[], text[], smallint[], integer, boolean);

CREATE FUNCTION outbox_record_failures(
    p_ids bigint[],
    p_reasons text[],
    p_kinds smallint[],
    p_max_attempts integer,
    p_block_key boolean,
    p_relay text,
    p_partitions integer[],
    p_epochs bigint[]
) RETURNS TABLE (id bigint, attempts integer, parked boolean, outcome text)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    -- A takeover (outbox_lease) takes this lock exclusively: it waits for this call, and
    -- this call sees the partitions as they are after any takeover that came first.
    PERFORM pg_advisory_xact_lock_shared(outbox_claim_lock_key());
    RETURN QUERY
    WITH mine AS (
        SELECT p.partition
          FROM outbox_partitions p, unnest(p_partitions, p_epochs) AS l(partition, epoch)
         WHERE p.partition = l.partition AND p.epoch = l.epoch
           AND p.owner = p_relay AND p.lease_until > clock_timestamp()
    ), f AS (
        SELECT * FROM unnest(p_ids, p_reasons, p_kinds) AS f(id, reason, kind)
    ), u AS (
        UPDATE outbox_events e
           SET attempts = e.attempts + 1,
               last_error = f.reason,
               parked_at = CASE WHEN f.kind = 2 OR (f.kind = 1 AND e.attempts + 1 >= p_max_attempts)
                                THEN now() END,
               seq = CASE WHEN f.kind = 2 OR (f.kind = 1 AND e.attempts + 1 >= p_max_attempts)
                          THEN coalesce((SELECT n.seq
                                           FROM outbox_key_seq k,
                                                unnest(k.numbered_ids, k.numbered_seqs) AS n(id, seq)
                                          WHERE k.aggregate_type = e.aggregate_type
                                            AND k.aggregate_id = e.aggregate_id
                                            AND n.id = e.id), e.seq)
                          ELSE e.seq END
          FROM f
         WHERE e.id = f.id AND e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND outbox_partition_of(e.aggregate_type, e.aggregate_id) IN (SELECT m.partition FROM mine m)
        RETURNING e.id, e.aggregate_type, e.aggregate_id, e.seq, e.attempts,
                  e.parked_at IS NOT NULL AS parked
    ), unnumbered AS (
        -- Rows numbered before migration 0007 carry their number in outbox_events too.
        -- One failed row per key per call (the relay has one unconfirmed row per key),
        -- so these are never rows of u.
        UPDATE outbox_events o SET seq = NULL
          FROM u
         WHERE p_block_key AND u.parked
           AND o.aggregate_type = u.aggregate_type AND o.aggregate_id = u.aggregate_id
           AND o.seq > u.seq AND o.dispatched_at IS NULL AND o.parked_at IS NULL
        RETURNING o.id
    ), rewound AS (
        UPDATE outbox_key_seq k
           SET last_seq = u.seq,
               numbered_ids = ARRAY(SELECT n.id FROM unnest(k.numbered_ids, k.numbered_seqs) WITH ORDINALITY AS n(id, seq, o)
                                     WHERE n.seq <= u.seq ORDER BY n.o),
               numbered_seqs = ARRAY(SELECT n.seq FROM unnest(k.numbered_seqs) WITH ORDINALITY AS n(seq, o)
                                      WHERE n.seq <= u.seq ORDER BY n.o)
          FROM u
         WHERE p_block_key AND u.parked
           AND k.aggregate_type = u.aggregate_type AND k.aggregate_id = u.aggregate_id
           AND k.last_seq > u.seq
        RETURNING k.last_seq
    )
    SELECT u.id, u.attempts, u.parked, 'recorded'::text FROM u
    UNION ALL
    -- The ids this call did not change, as they were when it started.
    SELECT f.id, coalesce(e.attempts, 0), coalesce(e.parked_at IS NOT NULL, false),
           CASE WHEN e.id IS NULL THEN 'gone'
                WHEN outbox_partition_of(e.aggregate_type, e.aggregate_id) NOT IN (SELECT m.partition FROM mine m)
                     THEN 'fenced'
                WHEN e.dispatched_at IS NOT NULL THEN 'dispatched'
                WHEN e.parked_at IS NOT NULL THEN 'parked'
                ELSE 'gone' END
      FROM f LEFT JOIN outbox_events e ON e.id = f.id
     WHERE NOT EXISTS (SELECT 1 FROM u WHERE u.id = f.id);
END
$$;

DO $$
DECLARE
    v_acl aclitem[] := (SELECT proacl FROM outbox_failures_acl);
    v_fn  text := 'outbox_record_failures(bigint[], text[], smallint[], integer, boolean, text, integer[], bigint[])';
    r     record;
BEGIN
    IF v_acl IS NULL THEN
        RETURN;
    END IF;
    EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', v_fn);
    FOR r IN SELECT DISTINCT a.grantee FROM aclexplode(v_acl) a WHERE a.privilege_type = 'EXECUTE' LOOP
        IF r.grantee = 0 THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', v_fn);
        ELSE
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', v_fn, r.grantee::regrole::text);
        END IF;
    END LOOP;
END
$$;

-- A re-drive that renumbers a key also lifts the key's counter to at least the highest
-- number the key has published, so the numbers it hands out next can never repeat one a
-- consumer has already seen (however the key's counter was rewound before). Reads the
-- key's dispatched rows: a re-drive is an operator's act, not a hot path.
CREATE FUNCTION outbox_redrive_counter_floor() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    IF NEW.parked_at IS NULL AND OLD.parked_at IS NOT NULL AND NEW.seq IS NULL THEN
        UPDATE outbox_key_seq k
           SET last_seq = greatest(k.last_seq,
                                   (SELECT max(o.seq) FROM outbox_events o
                                     WHERE o.aggregate_type = NEW.aggregate_type
                                       AND o.aggregate_id = NEW.aggregate_id
                                       AND o.dispatched_at IS NOT NULL))
         WHERE k.aggregate_type = NEW.aggregate_type AND k.aggregate_id = NEW.aggregate_id;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_events_redrive_floor AFTER UPDATE OF parked_at ON outbox_events
    FOR EACH ROW WHEN (OLD.parked_at IS NOT NULL AND NEW.parked_at IS NULL)
    EXECUTE FUNCTION outbox_redrive_counter_floor();

-- The one SECURITY DEFINER function again, hardened: its search_path was captured from the
-- migration's session without pg_temp, and pg_temp not listed is searched FIRST, so a
-- caller's temporary table or view named outbox_events could stand in for the real one.
-- Now pg_temp comes last and every name is qualified with the schema it was created in.
DO $do$
BEGIN
    EXECUTE format($f$
CREATE OR REPLACE FUNCTION %1$I.outbox_refresh_statistics(p_seen integer) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = %1$I, pg_temp
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_stat_user_tables t
                WHERE t.relid = '%1$I.outbox_events'::regclass
                  AND greatest(t.last_analyze, t.last_autoanalyze) > now() - interval '10 seconds')
       OR (SELECT s.null_frac * c.reltuples
             FROM pg_catalog.pg_stats s, pg_catalog.pg_class c
            WHERE s.schemaname = %1$L AND s.tablename = 'outbox_events'
              AND s.attname = 'dispatched_at' AND c.oid = '%1$I.outbox_events'::regclass) >= p_seen
    THEN
        RETURN false;
    END IF;
    ANALYZE (SKIP_LOCKED) %1$I.outbox_events;
    RETURN true;
END;
$$
$f$, current_schema());
END
$do$;
