-- Claims that cost little while the relay keeps up.
--
-- At a steady 500 to 1,000 events/s a relay claims a few hundred times a second, a few rows
-- each, and most claims find little or nothing. Such a claim cost about 1 ms of Postgres
-- CPU whatever it found (measured by calling it empty in a loop: 1.07 ms), because its
-- first statement (which keys to look at) was planned again on every call: 1.2 ms of
-- planning for 0.1 ms of execution. 0011 already ran the numbering step on cached plans
-- for small claims; the key scan now does too, decided before it runs, from the keys named
-- and the rows held (it reads at most p_limit rows by index in either plan). An empty claim
-- now costs 0.41 ms. A claim that finds more than 32 keys goes back to plans made with its
-- values for the numbering step, as before.
--
-- The check that a key has no parked row is written as a plain NOT EXISTS (the flag
-- p_block_parked_keys inside it) instead of inside an OR. Inside the OR Postgres may run it
-- as one hashed read of every parked row's key; a cached plan made while few rows were
-- parked would keep doing that however many are parked later. As a NOT EXISTS it is an
-- anti join, probed by key in outbox_events_parked.
--
-- Same arguments and result: outbox_claim is replaced in place and keeps its grants.

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
    per_key integer,
    next_due double precision,
    unreadable text
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
    v_check   boolean := current_setting('server_encoding') = 'SQL_ASCII';
    v_next_due double precision;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(outbox_claim_lock_key());

    SELECT array_agg(p.partition) INTO v_owned
      FROM outbox_partitions p
     WHERE p.owner = p_relay AND p.lease_until > clock_timestamp();
    IF v_owned IS NULL THEN
        RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL, NULL, NULL, NULL, NULL, NULL::integer,
                            NULL, NULL, NULL, NULL::float8, NULL, NULL::integer, NULL::bigint,
                            NULL::integer, p_after, 0, 0, NULL::float8, NULL::text;
        RETURN;
    END IF;
    v_all := cardinality(v_owned) = 64;

    -- Keys to look at: those the relay named and those of scheduled rows now due (first),
    -- then those of the candidate rows in order of their oldest candidate. Candidates are
    -- rows that were due when inserted (outbox_events_pending, by id from the cursor);
    -- scheduled rows are read from outbox_events_scheduled only once due, so rows not yet
    -- due cost nothing here however many there are.
    -- A small claim (a relay keeping up with a trickle: a few keys, few rows in flight)
    -- runs its statements on plans made once per connection instead of planning them on
    -- every call: planning the scan below alone took 1.2 ms, most of an empty claim. Those
    -- plans are made without the call's values, so they are held to index scans and nested
    -- loops: what a few keys need whatever the tables' sizes, and never a scan of a whole
    -- table (a cached plan outlives the table size it was made for; see 0005). Whether the
    -- claim is small is known for sure only after the scan (how many keys it found); the
    -- scan reads at most p_limit rows by index in any plan, so it runs on the cached plan
    -- whenever the keys named and the rows held are few.
    IF cardinality(p_key_types) <= 32 AND cardinality(p_held) <= 256 THEN
        PERFORM set_config('plan_cache_mode', 'force_generic_plan', true),
                set_config('enable_seqscan', 'off', true),
                set_config('enable_bitmapscan', 'off', true),
                set_config('enable_hashjoin', 'off', true),
                set_config('enable_mergejoin', 'off', true);
    END IF;

    WITH cand AS (
        SELECT e.id, e.aggregate_type, e.aggregate_id
          FROM outbox_events e
         WHERE e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at <= e.created_at
           AND e.available_at <= now()
           AND e.id > p_after
           AND (p_before IS NULL OR e.id <= p_before)
           AND NOT (e.id = ANY (p_held))
           AND (v_all OR outbox_partition_of(e.aggregate_type, e.aggregate_id) = ANY (v_owned))
         ORDER BY e.id
         LIMIT p_limit
    ), due AS (
        -- Scheduled rows that are due, earliest first, for forward claims only (a sweep
        -- reads below the cursor, and these are not read by cursor at all), for at most
        -- half the claim. Keys that stay blocked are left out here, so they cannot fill
        -- this half claim after claim and hold back the rows due after them.
        SELECT e.aggregate_type, e.aggregate_id
          FROM outbox_events e
         WHERE p_before IS NULL
           AND e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at > e.created_at
           AND e.available_at <= now()
           AND NOT (e.id = ANY (p_held))
           AND (v_all OR outbox_partition_of(e.aggregate_type, e.aggregate_id) = ANY (v_owned))
           AND NOT EXISTS (SELECT 1 FROM outbox_events x
                            WHERE p_block_parked_keys
                              AND x.aggregate_type = e.aggregate_type
                              AND x.aggregate_id = e.aggregate_id
                              AND x.parked_at IS NOT NULL)
         ORDER BY e.available_at, e.id
         LIMIT greatest(p_limit / 2, 1)
    ), named AS (
        -- Keys named and keys with due scheduled rows are looked at whatever the cursor:
        -- first_id 0, so they never stop it.
        SELECT n.aggregate_type, n.aggregate_id, 0::bigint AS first_id
          FROM unnest(p_key_types, p_key_ids) AS n(aggregate_type, aggregate_id)
         WHERE v_all OR outbox_partition_of(n.aggregate_type, n.aggregate_id) = ANY (v_owned)
        UNION ALL
        SELECT d.aggregate_type, d.aggregate_id, 0::bigint FROM due d
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
     WHERE NOT EXISTS (SELECT 1 FROM outbox_events x
                        WHERE p_block_parked_keys
                          AND x.aggregate_type = k.aggregate_type
                          AND x.aggregate_id = k.aggregate_id
                          AND x.parked_at IS NOT NULL);

    IF v_scanned >= least(p_limit, 256) THEN
        PERFORM outbox_refresh_statistics(v_scanned);  -- see "Statistics" at the top
    END IF;

    -- The scan found many keys (a backlog): the numbering is planned with this call's
    -- values, as before.
    IF coalesce(cardinality(v_types), 0) > 32 OR cardinality(p_held) > 256 THEN
        PERFORM set_config('plan_cache_mode', 'force_custom_plan', true),
                set_config('enable_seqscan', 'on', true),
                set_config('enable_bitmapscan', 'on', true),
                set_config('enable_hashjoin', 'on', true),
                set_config('enable_mergejoin', 'on', true);
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

    -- When the earliest scheduled row not yet due becomes due (seconds from now), so that
    -- the relay claims then instead of at its next poll. Forward claims only; the first
    -- entry past now() of outbox_events_scheduled (another relay's row wakes this one for
    -- nothing, which costs one claim).
    IF p_before IS NULL THEN
        SELECT extract(epoch FROM min(e.available_at) - now())::float8 INTO v_next_due
          FROM outbox_events e
         WHERE e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at > e.created_at
           AND e.available_at > now();
    END IF;

    RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL, NULL, NULL, NULL, NULL, NULL::integer,
                        NULL, NULL, NULL, NULL::float8, NULL, NULL::integer, NULL::bigint,
                        NULL::integer, coalesce(v_scanned_to, p_after), coalesce(v_scanned, 0), v_per_key,
                        v_next_due, NULL::text;

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
    ), checked AS (
        -- In a SQL_ASCII database: the columns whose text is not UTF-8.
        SELECT r.*,
               CASE WHEN v_check THEN
                   nullif(concat_ws(', ',
                       CASE WHEN NOT outbox_utf8_valid(r.aggregate_type) THEN 'aggregate_type' END,
                       CASE WHEN NOT outbox_utf8_valid(r.aggregate_id) THEN 'aggregate_id' END,
                       CASE WHEN NOT outbox_utf8_valid(r.event_type) THEN 'event_type' END,
                       CASE WHEN NOT outbox_utf8_valid(r.routing_key) THEN 'routing_key' END,
                       CASE WHEN NOT outbox_utf8_valid(r.body) THEN 'payload' END,
                       CASE WHEN NOT outbox_utf8_valid(r.headers) THEN 'headers' END,
                       CASE WHEN NOT outbox_utf8_valid(r.traceparent) THEN 'traceparent' END,
                       CASE WHEN NOT outbox_utf8_valid(r.tracestate) THEN 'tracestate' END), '')
               END AS bad
          FROM r
    ), measured AS (
        -- The message's size as published: body, user headers, trace context and the
        -- text that becomes properties and headers (key, type, routing key).
        SELECT r.*,
               octet_length(r.aggregate_type) + octet_length(r.aggregate_id)
                 + octet_length(r.event_type) + octet_length(r.routing_key) AS key_bytes,
               octet_length(r.body) + octet_length(r.headers)
                 + coalesce(octet_length(r.traceparent), 0) + coalesce(octet_length(r.tracestate), 0)
                 + octet_length(r.aggregate_type) + octet_length(r.aggregate_id)
                 + octet_length(r.event_type) + octet_length(r.routing_key) AS message_bytes
          FROM checked r
    ), sized AS (
        -- What the relay will hold of each row: an oversized or unreadable one comes back
        -- without body, headers or trace context (it is parked, never published).
        SELECT m.*, m.message_bytes > p_max_message_bytes OR m.bad IS NOT NULL AS oversized,
               sum(CASE WHEN m.message_bytes > p_max_message_bytes OR m.bad IS NOT NULL THEN m.key_bytes
                        ELSE m.message_bytes END) OVER (ORDER BY m.ord) AS running
          FROM measured m
    )
    SELECT s.id, s.event_id,
           CASE WHEN s.bad IS NULL THEN s.aggregate_type ELSE encode(convert_to(s.aggregate_type, 'SQL_ASCII'), 'hex') END,
           CASE WHEN s.bad IS NULL THEN s.aggregate_id ELSE encode(convert_to(s.aggregate_id, 'SQL_ASCII'), 'hex') END,
           CASE WHEN s.bad IS NULL THEN s.event_type ELSE '' END,
           CASE WHEN s.bad IS NULL THEN s.routing_key ELSE '' END,
           CASE WHEN s.oversized THEN NULL ELSE s.body END,
           s.message_bytes,
           CASE WHEN s.oversized THEN NULL ELSE s.headers END,
           CASE WHEN s.oversized THEN NULL ELSE s.traceparent END,
           CASE WHEN s.oversized THEN NULL ELSE s.tracestate END,
           s.created_epoch, s.created_text,
           s.attempts, s.seq, s.partition, NULL::bigint, NULL::integer, NULL::integer, NULL::float8,
           CASE WHEN s.bad IS NOT NULL THEN 'unreadable row: ' || s.bad || ' not valid UTF-8' END
      FROM sized s
     WHERE s.ord = 1 OR s.running <= p_max_bytes
     ORDER BY s.ord;
END
$$;
