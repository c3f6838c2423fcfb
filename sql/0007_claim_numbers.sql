-- A claim numbers rows in outbox_key_seq; the event row is written once, when it is
-- dispatched (or parked), with its number.
--
-- Until now a claim wrote each new row's seq into outbox_events: a second update of the
-- wide row, never HOT (seq is in the per-key index), with a new entry in each of the five
-- indexes, on top of the update that marks it dispatched. In the benchmark's drain that
-- numbering step was the largest part of every claim (18 of 48 ms per 500 rows) and
-- claims pace the drain. Now the number lives in the key's row of outbox_key_seq, which
-- the claim updates anyway to hand out numbers: `numbered_ids`/`numbered_seqs` list the
-- key's rows that were numbered and may not have reached a final state yet, in seq
-- order. The number is committed before the row is published, as before, so a row
-- published again (a relay died, a lease moved) carries the same seq; the relay writes
-- it into outbox_events.seq when it marks the row dispatched, and parking writes it too.
-- So outbox_events.seq is set on dispatched and parked rows and NULL on pending ones
-- (except a parked row re-driven with its number kept).
--
-- Entries of rows that reached a final state are dropped the next time the key is
-- numbered; a claim treats only entries of still-pending rows as numbered.
--
-- Statistics. After a vacuum of an idle outbox Postgres believes no row is pending
-- (dispatched_at is never NULL in its sample), and it goes on believing so through a
-- burst of events until the table is analyzed again: with millions of dispatched rows,
-- hundreds of thousands of changes later. Believing the pending indexes empty, it read
-- every pending row once per key of a claim (40 s for a claim of 500 keys with 100,000
-- rows pending) and once per mark. So a claim that sees more candidates than the
-- statistics say are pending analyzes the table first (outbox_refresh_statistics, at
-- most once per 10 seconds; an ANALYZE reads a sample of 30,000 rows whatever the
-- table's size), and the probes by id write "pending" as
-- coalesce(dispatched_at, parked_at) IS NULL, which no partial index serves: they go by
-- primary key, whatever the statistics say.

ALTER TABLE outbox_key_seq
    ADD COLUMN numbered_ids  bigint[] NOT NULL DEFAULT '{}',
    ADD COLUMN numbered_seqs bigint[] NOT NULL DEFAULT '{}';

-- Rows numbered before this migration and still pending keep their numbers.
UPDATE outbox_key_seq k
   SET numbered_ids = x.ids, numbered_seqs = x.seqs
  FROM (SELECT e.aggregate_type, e.aggregate_id,
               array_agg(e.id ORDER BY e.seq) AS ids, array_agg(e.seq ORDER BY e.seq) AS seqs
          FROM outbox_events e
         WHERE e.seq IS NOT NULL AND e.dispatched_at IS NULL AND e.parked_at IS NULL
         GROUP BY e.aggregate_type, e.aggregate_id) x
 WHERE k.aggregate_type = x.aggregate_type AND k.aggregate_id = x.aggregate_id;

-- Analyzes outbox_events when its statistics say fewer rows are pending than p_seen (the
-- candidates one claim just found), unless it was analyzed in the last 10 seconds; true if
-- it did. The one SECURITY DEFINER function: ANALYZE needs the table's owner, and this
-- runs nothing else. (PUBLIC keeps EXECUTE, as on every function, so that a relay role
-- without roles.sql's grants still claims; roles.sql grants it to the relay role only.)
CREATE FUNCTION outbox_refresh_statistics(p_seen integer) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_stat_user_tables t
                WHERE t.relid = 'outbox_events'::regclass
                  AND greatest(t.last_analyze, t.last_autoanalyze) > now() - interval '10 seconds')
       OR (SELECT s.null_frac * c.reltuples
             FROM pg_stats s, pg_class c
            WHERE s.schemaname = current_schema() AND s.tablename = 'outbox_events'
              AND s.attname = 'dispatched_at' AND c.oid = 'outbox_events'::regclass) >= p_seen
    THEN
        RETURN false;
    END IF;
    ANALYZE (SKIP_LOCKED) outbox_events;
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION outbox_claim(
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
    -- Named here so that the small-claim settings below end with the call.
    SET enable_seqscan = on SET enable_bitmapscan = on SET enable_hashjoin = on SET enable_mergejoin = on
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
    v_seqs    bigint[];
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

    IF v_scanned >= least(p_limit, 256) THEN
        PERFORM outbox_refresh_statistics(v_scanned);  -- see "Statistics" at the top
    END IF;

    -- A small claim (a relay keeping up with a trickle: a few keys, few rows in flight)
    -- runs its two big statements on plans made once per connection instead of planning
    -- them on every call, which took 0.7 of 2.2 ms per claim at 1,000 events/s. Those plans
    -- are made without the call's values, so they are held to index scans and nested loops:
    -- what a few keys need whatever the tables' sizes, and never a scan of a whole table
    -- (a cached plan outlives the table size it was made for; see 0005). Bigger claims are
    -- planned with their values, as before.
    IF coalesce(cardinality(v_types), 0) <= 32 AND cardinality(p_held) <= 256 THEN
        PERFORM set_config('plan_cache_mode', 'force_generic_plan', true),
                set_config('enable_seqscan', 'off', true),
                set_config('enable_bitmapscan', 'off', true),
                set_config('enable_hashjoin', 'off', true),
                set_config('enable_mergejoin', 'off', true);
    END IF;

    -- Spread p_limit over the keys waiting: shallow prefixes for many keys, deep for few.
    v_per_key := greatest(1, least(p_per_key, ceil(p_limit::numeric / greatest(coalesce(cardinality(v_types), 0), 1))::integer));

    -- Each key's prefix, keys in order: its numbered rows still pending and not held (by
    -- seq), then its new rows (by id). Keys that do not fit in p_limit rows are left for
    -- the next claim: the cursor stops before the first candidate of the first such key.
    -- New rows get the key's next numbers in the same statement.
    WITH k AS (
        SELECT k.aggregate_type, k.aggregate_id, k.first_id, k.ord, s.last_seq,
               coalesce(s.numbered_ids, '{}') AS ids, coalesce(s.numbered_seqs, '{}') AS seqs
          FROM unnest(v_types, v_ids, v_firsts) WITH ORDINALITY AS k(aggregate_type, aggregate_id, first_id, ord)
          LEFT JOIN outbox_key_seq s
            ON s.aggregate_type = k.aggregate_type AND s.aggregate_id = k.aggregate_id
    ), live AS (
        -- The keys' numbered rows that are still pending: those the relay holds (it holds
        -- a row until its final write committed) and those the table says are pending.
        -- (Pending written as coalesce(...) IS NULL: the partial indexes cannot serve it,
        -- so each entry is probed by primary key; see "Statistics" at the top.)
        SELECT k.ord, u.id, u.seq, u.o, u.id = ANY (p_held) AS held
          FROM k
         CROSS JOIN LATERAL unnest(k.ids, k.seqs) WITH ORDINALITY AS u(id, seq, o)
         WHERE u.id = ANY (p_held)
            OR EXISTS (SELECT 1 FROM outbox_events e
                        WHERE e.id = u.id AND coalesce(e.dispatched_at, e.parked_at) IS NULL)
    ), q AS (
        SELECT k.ord, k.first_id, l.id, l.seq
          FROM live l JOIN k ON k.ord = l.ord
         WHERE NOT l.held
        UNION ALL
        SELECT k.ord, k.first_id, x.id, NULL::bigint
          FROM k
         CROSS JOIN LATERAL (
               SELECT e.id
                 FROM outbox_events e
                WHERE e.aggregate_type = k.aggregate_type
                  AND e.aggregate_id = k.aggregate_id
                  AND e.dispatched_at IS NULL AND e.parked_at IS NULL
                  AND e.available_at <= now()
                  AND NOT (e.id = ANY (p_held))
                  AND NOT (e.id = ANY (k.ids))
                ORDER BY e.seq NULLS LAST, e.id
                LIMIT v_per_key) x
    ), r AS (
        SELECT q.*, row_number() OVER (PARTITION BY q.ord ORDER BY q.seq NULLS LAST, q.id) AS rk
          FROM q
    ), n AS (
        SELECT r.*, row_number() OVER (ORDER BY r.ord, r.rk) AS n FROM r WHERE r.rk <= v_per_key
    ), picked AS (
        SELECT * FROM n WHERE n.n <= p_limit
    ), plan AS (
        -- Per key with new rows picked: its row as this statement's snapshot saw it, the
        -- entries to keep (rows still pending) and the new rows, in order.
        SELECT k.ord, k.aggregate_type, k.aggregate_id, k.last_seq, k.ids,
               coalesce(l.ids, '{}') AS live_ids, coalesce(l.seqs, '{}') AS live_seqs, f.ids AS fresh
          FROM (SELECT p.ord, array_agg(p.id ORDER BY p.rk) AS ids
                  FROM picked p WHERE p.seq IS NULL GROUP BY p.ord) f
          JOIN k ON k.ord = f.ord
          LEFT JOIN (SELECT l.ord, array_agg(l.id ORDER BY l.o) AS ids, array_agg(l.seq ORDER BY l.o) AS seqs
                       FROM live l GROUP BY l.ord) l ON l.ord = f.ord
    ), updated AS (
        -- Only if the key's row is as the snapshot saw it (an operator's re-drive or a
        -- blocked key's rewind may have changed it meanwhile; then its new rows wait for
        -- the next claim).
        UPDATE outbox_key_seq s
           SET last_seq = s.last_seq + cardinality(p.fresh),
               numbered_ids = p.live_ids || p.fresh,
               numbered_seqs = p.live_seqs
                               || ARRAY(SELECT s.last_seq + g FROM generate_series(1, cardinality(p.fresh)) AS g)
          FROM plan p
         WHERE p.last_seq IS NOT NULL
           AND s.aggregate_type = p.aggregate_type AND s.aggregate_id = p.aggregate_id
           AND s.last_seq = p.last_seq AND s.numbered_ids = p.ids
        RETURNING s.aggregate_type, s.aggregate_id
    ), inserted AS (
        INSERT INTO outbox_key_seq AS s (aggregate_type, aggregate_id, last_seq, numbered_ids, numbered_seqs)
        SELECT p.aggregate_type, p.aggregate_id, cardinality(p.fresh), p.fresh,
               ARRAY(SELECT generate_series(1, cardinality(p.fresh))::bigint)
          FROM plan p
         WHERE p.last_seq IS NULL
        ON CONFLICT (aggregate_type, aggregate_id) DO NOTHING
        RETURNING s.aggregate_type, s.aggregate_id
    ), numbered AS (
        SELECT p.ord, p.fresh, coalesce(p.last_seq, 0) AS base
          FROM plan p
          JOIN (SELECT * FROM updated UNION ALL SELECT * FROM inserted) b
            ON b.aggregate_type = p.aggregate_type AND b.aggregate_id = p.aggregate_id
    )
    -- A key whose new rows were not numbered stops the cursor like a key that did not fit.
    SELECT array_agg(p.id ORDER BY p.n) FILTER (WHERE p.seq IS NOT NULL OR nb.ord IS NOT NULL),
           array_agg(coalesce(p.seq, nb.base + array_position(nb.fresh, p.id)) ORDER BY p.n)
               FILTER (WHERE p.seq IS NOT NULL OR nb.ord IS NOT NULL),
           least((SELECT min(x.first_id) FROM n x WHERE x.n > p_limit AND x.first_id > 0),
                 min(p.first_id) FILTER (WHERE p.seq IS NULL AND nb.ord IS NULL AND p.first_id > 0))
      INTO v_picked, v_seqs, v_cut
      FROM picked p
      LEFT JOIN numbered nb ON nb.ord = p.ord;
    IF v_cut IS NOT NULL THEN
        v_scanned_to := v_cut - 1;
    END IF;

    RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL, NULL, NULL, NULL, NULL, NULL::integer,
                        NULL, NULL, NULL, NULL::float8, NULL, NULL::integer, NULL::bigint,
                        NULL::integer, coalesce(v_scanned_to, p_after), coalesce(v_scanned, 0), v_per_key;

    RETURN QUERY
    WITH r AS MATERIALIZED (
        SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.event_type,
               coalesce(e.routing_key, e.aggregate_type || '.' || e.event_type) AS routing_key,
               e.payload::text AS body, e.headers::text AS headers, e.traceparent, e.tracestate,
               extract(epoch FROM e.created_at)::float8 AS created_epoch,
               to_char(e.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS created_text,
               e.attempts, p.seq,
               outbox_partition_of(e.aggregate_type, e.aggregate_id) AS partition,
               p.ord
          FROM unnest(v_picked, v_seqs) WITH ORDINALITY AS p(id, seq, ord)
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

-- Parking writes the row's number (from its key's entries) into outbox_events.seq. With
-- p_block_key the key's later rows lose their (unpublished) numbers and the key's counter
-- goes back to the parked row's seq, as before; now that is an edit of the key's entries.
CREATE OR REPLACE FUNCTION outbox_record_failures(
    p_ids bigint[],
    p_reasons text[],
    p_kinds smallint[],
    p_max_attempts integer,
    p_block_key boolean
) RETURNS TABLE (id bigint, attempts integer, parked boolean)
LANGUAGE sql SET search_path FROM CURRENT
AS $$
    WITH f AS (
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
    SELECT u.id, u.attempts, u.parked FROM u
$$;

-- Re-drive as before; a row that keeps its number becomes a numbered pending row again,
-- so its number goes back into its key's entries, and a renumbered one loses its entry. A
-- key's rows numbered and not yet final count as "after" a re-driven row like the
-- dispatched ones do.
CREATE OR REPLACE FUNCTION outbox_redrive(p_ids bigint[], p_dry_run boolean DEFAULT false)
RETURNS TABLE (id bigint, event_id uuid, aggregate_type text, aggregate_id text, seq_before bigint, renumbered boolean)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH sel AS (
        SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.seq
          FROM outbox_events e
         WHERE e.id = ANY (p_ids) AND e.parked_at IS NOT NULL
    ), renumber AS (
        SELECT DISTINCT s.aggregate_type, s.aggregate_id
          FROM sel s
         WHERE s.seq IS NULL
            OR EXISTS (SELECT 1 FROM outbox_events o
                        WHERE o.aggregate_type = s.aggregate_type AND o.aggregate_id = s.aggregate_id
                          AND o.seq > s.seq AND NOT (o.id = ANY (p_ids)))
            OR EXISTS (SELECT 1 FROM outbox_key_seq k, unnest(k.numbered_ids, k.numbered_seqs) AS n(id, seq)
                        WHERE k.aggregate_type = s.aggregate_type AND k.aggregate_id = s.aggregate_id
                          AND n.seq > s.seq AND NOT (n.id = ANY (p_ids)))
    ), plan AS (
        SELECT s.*, EXISTS (SELECT 1 FROM renumber r
                             WHERE r.aggregate_type = s.aggregate_type
                               AND r.aggregate_id = s.aggregate_id) AS renumbered
          FROM sel s
    ), redriven AS (
        UPDATE outbox_events e
           SET parked_at = NULL,
               attempts = 0,
               seq = CASE WHEN plan.renumbered THEN NULL ELSE e.seq END
          FROM plan
         WHERE e.id = plan.id AND NOT p_dry_run
        RETURNING e.id
    ), entries AS (
        -- The re-driven rows' old entries go (a parked row's entry stays until its key is
        -- numbered again; left in place, a renumbered row would go out with its old
        -- number); those that keep their number get it back.
        UPDATE outbox_key_seq k
           SET numbered_ids = ARRAY(SELECT n.id FROM unnest(k.numbered_ids, k.numbered_seqs) WITH ORDINALITY AS n(id, seq, o)
                                     WHERE NOT (n.id = ANY (x.ids)) ORDER BY n.o) || x.kept_ids,
               numbered_seqs = ARRAY(SELECT n.seq FROM unnest(k.numbered_ids, k.numbered_seqs) WITH ORDINALITY AS n(id, seq, o)
                                      WHERE NOT (n.id = ANY (x.ids)) ORDER BY n.o) || x.kept_seqs
          FROM (SELECT p.aggregate_type, p.aggregate_id, array_agg(p.id) AS ids,
                       coalesce(array_agg(p.id ORDER BY p.seq) FILTER (WHERE NOT p.renumbered), '{}') AS kept_ids,
                       coalesce(array_agg(p.seq ORDER BY p.seq) FILTER (WHERE NOT p.renumbered), '{}') AS kept_seqs
                  FROM plan p
                 GROUP BY p.aggregate_type, p.aggregate_id) x
         WHERE NOT p_dry_run
           AND k.aggregate_type = x.aggregate_type AND k.aggregate_id = x.aggregate_id
        RETURNING k.aggregate_type
    )
    SELECT plan.id, plan.event_id, plan.aggregate_type, plan.aggregate_id, plan.seq, plan.renumbered
      FROM plan
     ORDER BY plan.id;

    IF NOT p_dry_run THEN
        PERFORM pg_notify('outbox_events:' || current_schema(), '');
    END IF;
END
$$;
