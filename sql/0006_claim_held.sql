-- outbox_claim leaves out the rows the relay already holds (p_held).
--
-- A key's prefix starts at its first pending row. Rows the relay holds are pending until
-- their mark commits (queued, in flight, or confirmed and waiting for the mark), so each
-- claim read them again, returned them, and the relay skipped them: with 1,000 keys and
-- about two held rows per key, a good part of every claim's limit, per-key reads and
-- read-out went to rows already in hand, and claims, one at a time, pace the drain
-- (BENCHMARKS.md, Open findings). Held rows are published before anything a claim
-- returns for their key (the relay appends new rows behind them, and refuses a key whose
-- held row it dropped while the claim ran), so leaving them out keeps each key's order.
--
-- The new parameter comes last with a default, so a relay that passes ten arguments still
-- calls it (and gets the old behaviour). The grants on the old function carry over.

CREATE TEMPORARY TABLE outbox_claim_acl ON COMMIT DROP AS
    SELECT proacl FROM pg_proc
     WHERE oid = 'outbox_claim(text, bigint, integer, integer, boolean, integer, bigint, text[], text[], bigint)'::regprocedure;

DROP FUNCTION outbox_claim(text, bigint, integer, integer, boolean, integer, bigint, text[], text[], bigint);

CREATE FUNCTION outbox_claim(
    p_relay text,
    p_after bigint,
    p_limit integer,
    p_per_key integer,
    p_block_parked_keys boolean,
    p_max_message_bytes integer,
    p_max_bytes bigint,
    p_key_types text[] DEFAULT '{}',
    p_key_ids text[] DEFAULT '{}',
    p_before bigint DEFAULT NULL,
    p_held bigint[] DEFAULT '{}'
) RETURNS TABLE (
    id bigint,
    event_id uuid,
    aggregate_type text,
    aggregate_id text,
    event_type text,
    routing_key text,
    body text,
    body_bytes integer,
    headers text,
    traceparent text,
    tracestate text,
    created_epoch double precision,
    created_text text,
    attempts integer,
    seq bigint,
    partition integer,
    scanned_to bigint,
    scanned integer,
    per_key integer
)
LANGUAGE plpgsql SET search_path FROM CURRENT SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
DECLARE
    v_owned   integer[];
    v_all     boolean;
    v_scanned_to bigint;
    v_scanned integer;
    v_types   text[];
    v_ids     text[];
    v_firsts  bigint[];
    v_per_key integer;
    v_picked  bigint[];
    v_cut     bigint;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(outbox_claim_lock_key());

    SELECT array_agg(p.partition) INTO v_owned
      FROM outbox_partitions p
     WHERE p.owner = p_relay AND p.lease_until > clock_timestamp();
    IF v_owned IS NULL THEN
        RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL, NULL, NULL, NULL, NULL, NULL::integer,
                            NULL, NULL, NULL, NULL::float8, NULL, NULL::integer, NULL::bigint,
                            NULL::integer, p_after, 0, 0;
        RETURN;
    END IF;
    v_all := cardinality(v_owned) = 64;

    -- Keys to look at: those the relay named (first), then those of the candidate rows in
    -- order of their oldest candidate.
    WITH cand AS (
        SELECT e.id, e.aggregate_type, e.aggregate_id
          FROM outbox_events e
         WHERE e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at <= now()
           AND e.id > p_after
           AND (p_before IS NULL OR e.id <= p_before)
           AND NOT (e.id = ANY (p_held))
           AND (v_all OR outbox_partition_of(e.aggregate_type, e.aggregate_id) = ANY (v_owned))
         ORDER BY e.id
         LIMIT p_limit
    ), named AS (
        SELECT n.aggregate_type, n.aggregate_id, 0::bigint AS first_id
          FROM unnest(p_key_types, p_key_ids) AS n(aggregate_type, aggregate_id)
         WHERE v_all OR outbox_partition_of(n.aggregate_type, n.aggregate_id) = ANY (v_owned)
    ), keys AS (
        SELECT u.aggregate_type, u.aggregate_id, min(u.first_id) AS first_id
          FROM (SELECT c.aggregate_type, c.aggregate_id, c.id AS first_id FROM cand c
                UNION ALL
                SELECT * FROM named) u
         GROUP BY u.aggregate_type, u.aggregate_id
    )
    SELECT (SELECT max(c.id) FROM cand c),
           (SELECT count(*) FROM cand c),
           array_agg(k.aggregate_type ORDER BY k.first_id),
           array_agg(k.aggregate_id ORDER BY k.first_id),
           array_agg(k.first_id ORDER BY k.first_id)
      INTO v_scanned_to, v_scanned, v_types, v_ids, v_firsts
      FROM keys k
     WHERE NOT p_block_parked_keys
        OR NOT EXISTS (SELECT 1 FROM outbox_events x
                        WHERE x.aggregate_type = k.aggregate_type
                          AND x.aggregate_id = k.aggregate_id
                          AND x.parked_at IS NOT NULL);

    -- Spread p_limit over the keys waiting: shallow prefixes for many keys, deep for few.
    v_per_key := greatest(1, least(p_per_key, ceil(p_limit::numeric / greatest(coalesce(cardinality(v_types), 0), 1))::integer));

    -- Each key's prefix, keys in order. Keys that do not fit in p_limit rows are left for
    -- the next claim: the cursor stops before the first candidate of the first such key.
    WITH q AS (
        SELECT k.ord, k.first_id, x.id, x.seq
          FROM unnest(v_types, v_ids, v_firsts) WITH ORDINALITY AS k(aggregate_type, aggregate_id, first_id, ord)
         CROSS JOIN LATERAL (
               SELECT e.id, e.seq
                 FROM outbox_events e
                WHERE e.aggregate_type = k.aggregate_type
                  AND e.aggregate_id = k.aggregate_id
                  AND e.dispatched_at IS NULL AND e.parked_at IS NULL
                  AND e.available_at <= now()
                  AND NOT (e.id = ANY (p_held))
                ORDER BY e.seq NULLS LAST, e.id
                LIMIT v_per_key) x
    ), n AS (
        SELECT q.*, row_number() OVER (ORDER BY q.ord, q.seq NULLS LAST, q.id) AS n FROM q
    )
    SELECT array_agg(n.id ORDER BY n.n) FILTER (WHERE n.n <= p_limit),
           min(n.first_id) FILTER (WHERE n.n > p_limit AND n.first_id > 0)
      INTO v_picked, v_cut
      FROM n;
    IF v_cut IS NOT NULL THEN
        v_scanned_to := v_cut - 1;
    END IF;

    WITH need AS (
        SELECT e.id, e.aggregate_type, e.aggregate_id,
               row_number() OVER (PARTITION BY e.aggregate_type, e.aggregate_id ORDER BY e.id) AS rn,
               count(*) OVER (PARTITION BY e.aggregate_type, e.aggregate_id) AS n
          FROM outbox_events e
         WHERE e.id = ANY (v_picked) AND e.seq IS NULL
    ), bumped AS (
        INSERT INTO outbox_key_seq AS s (aggregate_type, aggregate_id, last_seq)
        SELECT DISTINCT need.aggregate_type, need.aggregate_id, need.n FROM need
        ON CONFLICT (aggregate_type, aggregate_id)
        DO UPDATE SET last_seq = s.last_seq + excluded.last_seq
        RETURNING s.aggregate_type, s.aggregate_id, s.last_seq
    )
    UPDATE outbox_events e
       SET seq = b.last_seq - need.n + need.rn
      FROM need
      JOIN bumped b ON b.aggregate_type = need.aggregate_type AND b.aggregate_id = need.aggregate_id
     WHERE e.id = need.id;

    RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL, NULL, NULL, NULL, NULL, NULL::integer,
                        NULL, NULL, NULL, NULL::float8, NULL, NULL::integer, NULL::bigint,
                        NULL::integer, coalesce(v_scanned_to, p_after), coalesce(v_scanned, 0), v_per_key;

    RETURN QUERY
    WITH r AS (
        SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.event_type,
               coalesce(e.routing_key, e.aggregate_type || '.' || e.event_type) AS routing_key,
               e.payload::text AS body, e.headers::text AS headers, e.traceparent, e.tracestate,
               extract(epoch FROM e.created_at)::float8 AS created_epoch,
               to_char(e.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS created_text,
               e.attempts, e.seq,
               outbox_partition_of(e.aggregate_type, e.aggregate_id) AS partition,
               p.ord
          FROM unnest(v_picked) WITH ORDINALITY AS p(id, ord)
          JOIN outbox_events e ON e.id = p.id
    ), sized AS (
        SELECT r.*, octet_length(r.body) AS body_bytes,
               sum(CASE WHEN octet_length(r.body) > p_max_message_bytes THEN 0
                        ELSE octet_length(r.body) END) OVER (ORDER BY r.ord) AS running
          FROM r
    )
    SELECT s.id, s.event_id, s.aggregate_type, s.aggregate_id, s.event_type, s.routing_key,
           CASE WHEN s.body_bytes > p_max_message_bytes THEN NULL ELSE s.body END,
           s.body_bytes, s.headers, s.traceparent, s.tracestate, s.created_epoch, s.created_text,
           s.attempts, s.seq, s.partition, NULL::bigint, NULL::integer, NULL::integer
      FROM sized s
     WHERE s.ord = 1 OR s.running <= p_max_bytes
     ORDER BY s.ord;
END
$$;

-- Grants as they were: roles.sql may have taken EXECUTE from PUBLIC and given it to the
-- relay's role (NULL is the default: PUBLIC may execute).
DO $$
DECLARE
    v_acl aclitem[] := (SELECT proacl FROM outbox_claim_acl);
    v_fn  text := 'outbox_claim(text, bigint, integer, integer, boolean, integer, bigint, text[], text[], bigint, bigint[])';
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
